"""What this repository's tests and benchmarks share, outside the installed package: the synthetic
engine, a host-memory CUDA driver, vLLM step drivers, fault injection, and Redis, Mooncake and S3
servers to test against."""
