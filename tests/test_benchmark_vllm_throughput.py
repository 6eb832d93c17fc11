"""The vLLM benchmark's throughput part: per-round ratios, their interval and verdict, and the
engine whose connector is swapped between rounds."""

from __future__ import annotations

import random
from pathlib import Path
from types import ModuleType

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama


@pytest.fixture(scope="module")
def throughput(benchmarks_on_path: None) -> ModuleType:
    import vllm_bench.throughput

    return vllm_bench.throughput


def test_equal_arms_give_a_ratio_of_one_and_pass(throughput: ModuleType) -> None:
    rounds = [100.0, 80.0, 120.0, 95.0]
    report = throughput.ratio_interval([rounds], [rounds])
    assert report["rounds"] == [1.0] * 4
    assert report["median"] == 1.0
    assert report["ci95"] == [1.0, 1.0]
    assert report["ok"]


def test_a_steady_loss_fails_and_its_interval_brackets_the_median(throughput: ModuleType) -> None:
    without = [100.0] * 9
    with_kvtier = [96.0, 97.0, 95.0, 96.5, 96.0, 97.5, 95.5, 96.0, 96.2]
    report = throughput.ratio_interval([with_kvtier], [without])
    low, high = report["ci95"]
    assert report["median"] == pytest.approx(0.96)
    assert low <= report["median"] <= high
    assert 0.95 <= low and high <= 0.975
    assert not report["ok"]


def test_a_wide_interval_fails_even_with_a_good_median(throughput: ModuleType) -> None:
    without = [100.0] * 8
    with_kvtier = [99.0, 100.0, 101.0, 99.5, 70.0, 130.0, 60.0, 140.0]
    report = throughput.ratio_interval([with_kvtier], [without])
    assert report["median"] >= 0.98
    assert report["ci95"][0] < 0.97
    assert not report["ok"]


def test_pairs_of_processes_with_a_speed_of_their_own_widen_the_interval(
    throughput: ModuleType,
) -> None:
    """Rounds agree within each pair of processes but the pairs disagree: each pair counts as
    one sample, so the interval spans the pairs' spread. Resampling the pooled rounds alone
    would give about [0.97, 1.03] and pass."""
    offsets = [1.06, 0.94, 1.03, 0.97, 1.0]
    jitter = [-0.2, 0.2, -0.1, 0.1, 0.0, 0.15, -0.15, 0.05]
    with_kvtier = [[100.0 * offset + d for d in jitter] for offset in offsets]
    without = [[100.0] * len(jitter) for _ in offsets]
    report = throughput.ratio_interval(with_kvtier, without)
    assert report["pair_medians"] == [pytest.approx(o, abs=1e-3) for o in offsets]
    assert report["median"] == pytest.approx(1.0, abs=1e-3)
    low, high = report["ci95"]
    assert low < 0.95 and high > 1.05
    assert not report["ok"]


@pytest.mark.vllm
def test_the_swap_method_takes_kvtier_out_of_the_engine_and_puts_it_back(
    throughput: ModuleType, tmp_path: Path, in_process_vllm: None
) -> None:
    """Only rounds run with kvtier store blocks; vLLM sees its connector, the do-nothing one or
    none, as the round's kind says; and no swap happens while a request is alive."""
    pytest.importorskip("vllm")
    from null_connector import NullConnector
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm_bench.patches import ConnectorSwitch

    from kvtier.integrations.vllm.connector import KVTierConnector
    from kvtier.integrations.vllm.offline import settle, shutdown

    shape = (2, 64, 4)  # two prompts of two full blocks each
    model_dir = write_tiny_llama(tmp_path / "model", TinyLlamaSpec())
    kvtier = {"cpu_bytes": "64MiB", "store_mode": "eager"}
    llm = throughput.throughput_engine(model_dir, kvtier, shape)
    try:
        switch = ConnectorSwitch(llm)
        manager = switch.kvtier.manager
        rng = random.Random(0)
        stored = []
        for kind, agent in (
            ("none", None),
            ("null", NullConnector),
            ("kvtier", KVTierConnector),
            ("none", None),
            ("null", NullConnector),
        ):
            switch.use(kind)
            assert has_kv_transfer_group() == (agent is not None)
            if agent is not None:
                assert isinstance(get_kv_transfer_group(), agent)
            before = manager.stats().stored_blocks
            throughput.throughput_round(llm, rng, shape, None)
            stored.append(manager.stats().stored_blocks - before)
        assert stored == [0, 0, 4, 0, 0]

        llm.llm_engine.add_request("alive", {"prompt_token_ids": [1] * 40}, SamplingParams())
        with pytest.raises(RuntimeError, match="between rounds"):
            switch.use("kvtier")
        settle(llm)
        switch.use("kvtier")
    finally:
        shutdown(llm)
    assert not has_kv_transfer_group()
