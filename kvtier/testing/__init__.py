"""Test helpers for kvtier and its plugins: a synthetic engine, fault injection, contract suites."""
