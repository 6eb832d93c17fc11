"""Served end to end: ``kvtier serve`` and plain vLLM's OpenAI server, answering over HTTP.

Two servers run side by side on 127.0.0.1 (random free ports), the same random-weight Llama
behind both: plain vLLM, and vLLM with kvtier started the way an operator starts it, as the
serving benchmark starts them. Two servers take a minute or more to start, so the module starts
one pair and every test here uses it. vLLM's own KV cache is too small for the prompts' shared
prefixes, so their second use is a kvtier hit. The replies must be equal, kvtier's hit counters
on ``/metrics`` must have moved, and kvtier's start-up lines must be in vLLM's log format. A
request's ``kv_transfer_params`` control it, and an invalid kvtier entry is answered 400 with its
one-line error. The serving benchmark, short (vLLM's benchmark client on those servers, a few
prompts of each dataset), must complete every request on both arms with the same greedy texts;
not speed.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
from tests.integrations.vllm.conftest import BLOCK
from tests.support.served import Server

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

REQUEST_TIMEOUT_S = 60.0
PREFIXES = 6
"""Six prefixes of six blocks: their first uses fill more than the servers' 32 device blocks."""


@pytest.fixture(scope="module")
def servers(
    benchmarks_on_path: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """Plain vLLM and kvtier serve by arm (``"vanilla"``, ``"kvtier"``), as the serving benchmark
    starts them; stopped however the tests end."""
    import serve_bench

    work = tmp_path_factory.mktemp("served")
    model = str(write_tiny_llama(work / "tiny-llama", TinyLlamaSpec()))
    with serve_bench.both_servers(model, work) as started:
        yield started


def _completion_request(
    server: Server, prompt: list[int], **fields: object
) -> urllib.request.Request:
    body = json.dumps(
        {
            "model": server.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0.0,
            "return_token_ids": True,
            **fields,
        }
    ).encode()
    return urllib.request.Request(
        server.url("/v1/completions"), body, {"Content-Type": "application/json"}
    )


def _complete(server: Server, prompt: list[int], **fields: object) -> list[int]:
    request = _completion_request(server, prompt, **fields)
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        choice = json.load(reply)["choices"][0]
    return list(choice["token_ids"])


def _kvtier_metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url("/metrics"), timeout=REQUEST_TIMEOUT_S) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvtier_"):
            name, value = line.rsplit(" ", 1)
            metric = name.split("{", 1)[0]
            values[metric] = values.get(metric, 0.0) + float(value)
    return values


def _prompts() -> list[list[int]]:
    """Six prefixes of six blocks, each used twice with other tails, the second round later."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(6 * BLOCK)] for _ in range(PREFIXES)]
    tails = [
        [rng.randrange(1000) for _ in range(rng.randrange(1, BLOCK))] for _ in range(2 * PREFIXES)
    ]
    return [prefix + tails[i] for i, prefix in enumerate(prefixes)] + [
        prefix + tails[PREFIXES + i] for i, prefix in enumerate(prefixes)
    ]


def _moved(before: dict[str, float], after: dict[str, float], metric: str) -> float:
    return after.get(metric, 0.0) - before.get(metric, 0.0)


def test_served_replies_match_plain_vllm_and_kvtier_hits(
    servers: dict[str, Server],
) -> None:
    plain, kvtier = servers["vanilla"], servers["kvtier"]
    # The servers also serve the other tests' requests: these prompts' hits are what the
    # counters move by.
    before = _kvtier_metrics(kvtier)
    for prompt in _prompts():
        assert _complete(kvtier, prompt) == _complete(plain, prompt)
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    metrics = _kvtier_metrics(kvtier)
    loaded = "vllm:kvtier_loaded_blocks_total"
    while _moved(before, metrics, loaded) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = _kvtier_metrics(kvtier)
    assert _moved(before, metrics, "vllm:kvtier_hit_tokens_total") > 0, (before, metrics)
    assert _moved(before, metrics, loaded) > 0, (before, metrics)
    assert metrics.get("vllm:kvtier_load_failures_total", 0) == 0, metrics
    assert _kvtier_metrics(plain) == {}


def test_kv_transfer_params_control_a_request_and_an_invalid_one_is_a_400(
    servers: dict[str, Server],
) -> None:
    plain, kvtier = servers["vanilla"], servers["kvtier"]
    prompt = _prompts()[0][:-1] + [11]
    control = {"kvtier": {"load": False, "store_max_tokens": BLOCK, "priority": "low"}}
    assert _complete(kvtier, prompt, kv_transfer_params=control) == _complete(plain, prompt)
    invalid = {"kvtier": {"store": "never"}}
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(
            _completion_request(kvtier, prompt, kv_transfer_params=invalid),
            timeout=REQUEST_TIMEOUT_S,
        )
    assert caught.value.code == 400
    assert json.load(caught.value)["error"]["message"] == (
        "kv_transfer_params: kvtier.store: Input should be a valid boolean (got 'never')"
    )
    assert _complete(kvtier, prompt) == _complete(plain, prompt), "the server still serves"


def test_kvtier_start_up_lines_are_in_vllm_log_format(servers: dict[str, Server]) -> None:
    log = servers["kvtier"].log.read_text(errors="replace")
    prefix = r"\((EngineCore|Worker)[^)]* pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[[^]]+\] "
    for role in ("scheduler", "worker"):
        summary = re.search(prefix + f"kvtier {role}: eager store mode, host tier 256.0MiB", log)
        assert summary is not None, f"no {role} start-up line in vLLM's format:\n{log[-4000:]}"
        assert "cpu_bytes=256.0MiB (file " in log[summary.end() :].splitlines()[0]
    assert re.search(prefix + "kvtier sets kv_load_failure_policy to 'recompute'", log)


def test_the_short_serving_benchmark_completes_every_prompt_with_the_same_greedy_text(
    servers: dict[str, Server], tmp_path: Path
) -> None:
    import serve_bench

    output = tmp_path / "serve.json"
    argv = ["--pairs", "1", "--num-prompts", "4", "--output-tokens", "3", "--uses-per-prefix", "4"]
    argv += ["--output", str(output)]
    assert serve_bench.main(argv, lambda model, work: contextlib.nullcontext(servers)) == 0
    report = json.loads(output.read_text())
    assert report["load"] == {
        "num_prompts": 4,
        "concurrency": 2,
        "output_tokens": 3,
        "uses_per_prefix": 4,
    }
    assert serve_bench.dataset_args("prefix-repetition", serve_bench.Load(4, 2, 3, 4))[-4:] == [
        "--prefix-repetition-num-prefixes",
        "1",
        "--prefix-repetition-output-len",
        "3",
    ]
    datasets = report["datasets"]
    assert sorted(datasets) == sorted(serve_bench.DATASETS)
    for name, dataset in datasets.items():
        for arm in serve_bench.ARMS:
            (run,) = dataset["arms"][arm]
            assert (run["completed"], run["failed"]) == (4, 0), (name, arm, run)
            # one prefix in both datasets: the first prompt uses it first, the others repeat it
            by_use = run["ttft_by_prefix_use"]
            assert (by_use["first_use"]["count"], by_use["repeat"]["count"]) == (1, 3), by_use
            assert run["repeat_mean_ttft_ms"] == by_use["repeat"]["mean"] > 0
        assert dataset["same_greedy_text"] == {"kvtier": True}, name
        (ratio,) = dataset["over_vanilla"]["kvtier"]["output_throughput"]["pairs"]
        assert ratio > 0
