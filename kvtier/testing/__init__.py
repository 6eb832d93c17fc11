"""Test helpers for kvtier and its plugins: a synthetic engine and contract test suites."""
