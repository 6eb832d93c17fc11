"""The parts of ``benchmarks/vllm_ttft.py``, one module each, and what they share.

- :mod:`vllm_bench.ttft`: cold prefill, device hit and tier hit, against the copy limit.
- :mod:`vllm_bench.busy`: a tier hit arriving while other requests decode.
- :mod:`vllm_bench.lower_tiers`: a hit found only in a disk or Redis tier.
- :mod:`vllm_bench.throughput`: 0%-hit throughput with and without the connector.
- :mod:`vllm_bench.engine`: the model, the engines' environment, prompts, timed batches.
- :mod:`vllm_bench.patches`: the timing wrappers inside vLLM, and the connector switch.
"""
