"""The serving benchmark, short: vLLM's benchmark client against vanilla vLLM and kvtier serve.

One pair of servers, a few prompts of each dataset; asserts that every request completed on
both arms and that their greedy texts are the same, not speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def test_both_arms_complete_every_prompt_with_the_same_greedy_text(
    benchmarks_on_path: None, tmp_path: Path
) -> None:
    import serve_bench

    output = tmp_path / "serve.json"
    assert serve_bench.main(["--pairs", "1", "--num-prompts", "4", "--output", str(output)]) == 0
    datasets = json.loads(output.read_text())["datasets"]
    assert sorted(datasets) == sorted(serve_bench.DATASETS)
    for name, dataset in datasets.items():
        for arm in serve_bench.ARMS:
            (run,) = dataset["arms"][arm]
            assert (run["completed"], run["failed"]) == (4, 0), (name, arm, run)
        assert dataset["same_greedy_text"], name
        (ratio,) = dataset["kvtier_over_vanilla"]["output_throughput"]["pairs"]
        assert ratio > 0
