"""Served end to end: ``kvtier serve`` and plain vLLM's OpenAI server, answering over HTTP.

Two servers start side by side on 127.0.0.1 (random free ports), the same
random-weight Llama behind both: plain vLLM, and vLLM with kvtier started the
way an operator starts it. vLLM's own KV cache is too small for the prompts'
shared prefixes, so their second use is a kvtier hit. The replies must be
equal, kvtier's hit counters on ``/metrics`` non-zero, and kvtier's start-up
lines in vLLM's log format. A request's ``kv_transfer_params`` control it, and
an invalid kvtier entry is answered 400 with its one-line error. The servers
are stopped however the test ends.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
from kvtier.integrations.serve import VLLM_SERVER_MODULE
from kvtier.testing.redis_server import free_port
from kvtier.testing.served import Server

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm

BLOCK = 32
START_TIMEOUT_S = 600.0
"""A minute or two on an idle two-core machine; far longer when other work shares it."""
REQUEST_TIMEOUT_S = 60.0

SERVER_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Same rounding whatever shares a step (see conftest.ENGINE_ENVIRONMENT).
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
    "VLLM_LOGGING_COLOR": "0",
}

VLLM_ARGS = [
    "--skip-tokenizer-init",
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK),
    "--max-model-len",
    "512",
    "--enforce-eager",
    "--seed",
    "0",
    # 16 usable blocks (vLLM keeps one back) of 512 tokens: two of the prompts below at a time,
    # so each prefix is evicted before it is used again.
    "--num-gpu-blocks-override",
    "17",
    # One process less per server: the worker runs in the engine-core process.
    "--distributed-executor-backend",
    "uni",
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    """(plain vLLM, vLLM with kvtier), started together so their start-ups overlap."""
    work = tmp_path_factory.mktemp("served")
    model = str(write_tiny_llama(work / "model", TinyLlamaSpec()))
    config = work / "kvtier.yaml"
    config.write_text("cpu_bytes: 64MiB\n")
    started: list[Server] = []
    try:
        port = free_port()
        started.append(
            Server.start(
                [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", model, "--port", str(port)]
                + ["--host", "127.0.0.1", *VLLM_ARGS],
                work / "plain.log",
                port,
                model,
                SERVER_ENVIRONMENT,
            )
        )
        port = free_port()
        started.append(
            Server.start(
                [sys.executable, "-m", "kvtier", "serve", "--kvtier-config", str(config), model]
                + ["--host", "127.0.0.1", "--port", str(port), *VLLM_ARGS],
                work / "kvtier.log",
                port,
                model,
                SERVER_ENVIRONMENT,
            )
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in started:
            server.wait_ready(deadline)
        yield started[0], started[1]
    finally:
        for server in started:
            server.stop()


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
    """Three prefixes of six blocks, each used twice with other tails, the second round later."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(6 * BLOCK)] for _ in range(3)]
    tails = [[rng.randrange(1000) for _ in range(rng.randrange(1, BLOCK))] for _ in range(6)]
    return [prefix + tails[i] for i, prefix in enumerate(prefixes)] + [
        prefix + tails[3 + i] for i, prefix in enumerate(prefixes)
    ]


def test_served_replies_match_plain_vllm_and_kvtier_hits(servers: tuple[Server, Server]) -> None:
    plain, kvtier = servers
    for prompt in _prompts():
        assert _complete(kvtier, prompt) == _complete(plain, prompt)
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    metrics = _kvtier_metrics(kvtier)
    while metrics.get("vllm:kvtier_loaded_blocks_total", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = _kvtier_metrics(kvtier)
    assert metrics["vllm:kvtier_hit_tokens_total"] > 0, metrics
    assert metrics["vllm:kvtier_loaded_blocks_total"] > 0, metrics
    assert metrics.get("vllm:kvtier_load_failures_total", 0) == 0, metrics
    assert _kvtier_metrics(plain) == {}


def test_kv_transfer_params_control_a_request_and_an_invalid_one_is_a_400(
    servers: tuple[Server, Server],
) -> None:
    plain, kvtier = servers
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


def test_kvtier_start_up_lines_are_in_vllm_log_format(servers: tuple[Server, Server]) -> None:
    log = servers[1].log.read_text(errors="replace")
    prefix = r"\((EngineCore|Worker)[^)]* pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[[^]]+\] "
    for role in ("scheduler", "worker"):
        summary = re.search(prefix + f"kvtier {role}: eager store mode, host tier 64.0MiB", log)
        assert summary is not None, f"no {role} start-up line in vLLM's format:\n{log[-4000:]}"
        assert "cpu_bytes=64.0MiB (file " in log[summary.end() :].splitlines()[0]
    assert re.search(prefix + "kvtier sets kv_load_failure_policy to 'recompute'", log)
