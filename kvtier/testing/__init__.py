"""Test helpers: a synthetic engine, a host-memory CUDA driver, fault injection, contract suites."""
