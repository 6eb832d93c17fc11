"""vLLM's own serving benchmark (``vllm bench serve``) against vanilla vLLM and ``kvtier serve``.

Each pair starts vLLM's OpenAI server twice on 127.0.0.1 (random free ports): vanilla
(``python -m vllm.entrypoints.openai.api_server``) and ``kvtier serve`` with a host tier, both
serving the same random-weight Llama with its tokenizer, with the same small device cache, the
same thread layout (``VLLM_CPU_NUM_OF_RESERVED_CPU`` set alike on both) and the same flags. The
two start together, then vLLM's benchmark client (run as a library, unmodified) sends each
prefix-heavy dataset to one and then the other, the order swapped from pair to pair, and both are
stopped however the run ends. Datasets: ``prefix-repetition`` (a few long prefixes, each shared by
several prompts; more prefixes than the device cache holds, so repeats come back from kvtier) and
``shared-prefix`` (random prompts behind one shared prefix, which stays in vLLM's own cache: what
kvtier costs when it has nothing to add). The JSON report holds per arm and dataset the client's
TTFT mean/median/p99 and throughput, kvtier's hit tokens from its metrics, and the kvtier/vanilla
ratios with a 95% interval over the pairs; greedy texts of the two arms are compared.

    python benchmarks/serve_bench.py [--pairs 4] [--num-prompts 64] [--output FILE]

Progress and the client's tables go to stderr; the report to stdout (or ``--output``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support

from stats import median_ci

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
from kvtier.integrations.serve import (
    RESERVED_CPU_VARIABLE,
    VLLM_SERVER_MODULE,
    vanilla_reserved_cpus,
)
from tests.support.redis_server import free_port
from tests.support.served import PortTaken, Server

ARMS = ("vanilla", "kvtier")
BLOCK = 32
PREFIX_TOKENS = 256
SUFFIX_TOKENS = 32
OUTPUT_TOKENS = 16
DEVICE_BLOCKS = 33
"""vLLM's own cache: 32 usable blocks (1,024 tokens), fewer than the prefixes of a run."""
START_TIMEOUT_S = 600.0
KVTIER_CONFIG = "cpu_bytes: 256MiB\nstore_mode: eager\n"

SERVER_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # The same rounding whatever shares a step, so the two arms' greedy texts can be compared.
    "VLLM_CPU_ATTN_SPLIT_KV": "0",
    "VLLM_LOGGING_COLOR": "0",
    # Both arms alike: what vLLM reserves without a connector (kvtier serve would set the same).
    RESERVED_CPU_VARIABLE: str(vanilla_reserved_cpus(1)),
}

SERVER_ARGS = [
    "--dtype",
    "float32",
    "--block-size",
    str(BLOCK),
    "--max-model-len",
    "1024",
    "--enforce-eager",
    "--seed",
    "0",
    "--num-gpu-blocks-override",
    str(DEVICE_BLOCKS),
]


def dataset_args(name: str, num_prompts: int) -> list[str]:
    """``vllm bench serve`` arguments of one of the two datasets."""
    if name == "prefix-repetition":
        return [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(PREFIX_TOKENS),
            "--prefix-repetition-suffix-len",
            str(SUFFIX_TOKENS),
            # Each prefix twice, in shuffled order; 8 blocks each, so the device cache keeps
            # fewer than 4 of them and most second uses find theirs evicted.
            "--prefix-repetition-num-prefixes",
            str(max(1, num_prompts // 2)),
            "--prefix-repetition-output-len",
            str(OUTPUT_TOKENS),
        ]
    if name == "shared-prefix":
        return [
            "--dataset-name",
            "random",
            "--random-prefix-len",
            str(PREFIX_TOKENS),
            "--random-input-len",
            str(SUFFIX_TOKENS),
            "--random-output-len",
            str(OUTPUT_TOKENS),
            "--random-range-ratio",
            "0",
        ]
    raise ValueError(f"unknown dataset {name!r}: choose prefix-repetition or shared-prefix")


DATASETS = ("prefix-repetition", "shared-prefix")


def server_command(arm: str, model: str, port: int, config: Path) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), *SERVER_ARGS]
    if arm == "vanilla":
        return [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", model, *common]
    return [sys.executable, "-m", "kvtier", "serve", "--kvtier-config", str(config), model, *common]


def start(arm: str, model: str, work: Path) -> Server:
    config = work / "kvtier.yaml"
    config.write_text(KVTIER_CONFIG)
    port = free_port()
    command = server_command(arm, model, port, config)
    return Server.start(command, work / f"{arm}-{port}.log", port, model, SERVER_ENVIRONMENT)


@contextlib.contextmanager
def both_servers(model: str, work: Path) -> Iterator[dict[str, Server]]:
    """Both arms' servers, started together so their start-ups overlap; stopped on exit. A server
    whose port another process took first starts again on another port."""
    started: dict[str, Server] = {}
    try:
        for arm in ARMS:
            started[arm] = start(arm, model, work)
        deadline = time.monotonic() + START_TIMEOUT_S
        for arm in ARMS:
            while True:
                try:
                    started[arm].wait_ready(deadline)
                    break
                except PortTaken:
                    started[arm] = start(arm, model, work)
        yield started
    finally:
        for server in started.values():
            server.stop()


ServerPair = Callable[[str, Path], contextlib.AbstractContextManager[dict[str, Server]]]
"""Gives a pair's running servers, by arm, for a model and a working directory (the tests pass
servers they share with other tests; :func:`both_servers` otherwise)."""


def counters(server: Server) -> dict[str, float]:
    """kvtier's counters and vLLM's prefix-cache counters on the server's ``/metrics``."""
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:kvtier_", "vllm:prefix_cache_")):
            name, value = line.rsplit(" ", 1)
            metric = name.split("{", 1)[0].removeprefix("vllm:")
            if metric.endswith("_total"):
                values[metric] = values.get(metric, 0.0) + float(value)
    return values


def bench_serve(server: Server, dataset: str, num_prompts: int, concurrency: int) -> dict[str, Any]:
    """One run of vLLM's benchmark client against ``server``; its result dictionary."""
    from vllm.benchmarks import serve as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    bench.add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            server.url(),
            "--model",
            server.model,
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(concurrency),
            "--temperature",
            "0",
            "--ignore-eos",
            "--seed",
            "0",
            "--disable-tqdm",
            # Two requests first, not measured: the first request of a server pays start-up
            # costs of its own.
            "--num-warmups",
            "2",
            "--save-detailed",
            "--percentile-metrics",
            "ttft,tpot,e2el",
            "--metric-percentiles",
            "50,99",
            *dataset_args(dataset, num_prompts),
        ]
    )
    with contextlib.redirect_stdout(sys.stderr):
        result: dict[str, Any] = bench.main(args)
    return result


RUN_FIELDS = (
    "completed",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)


def measure(server: Server, dataset: str, num_prompts: int, concurrency: int) -> dict[str, Any]:
    """The client's figures for one run, the counters it moved and its greedy texts."""
    before = counters(server)
    result = bench_serve(server, dataset, num_prompts, concurrency)
    after = counters(server)
    run = {field: result[field] for field in RUN_FIELDS}
    run["failed"] = num_prompts - result["completed"]
    run["counters"] = {name: after[name] - before.get(name, 0.0) for name in after}
    run["generated_texts"] = result["generated_texts"]
    return run


def ratios(runs: dict[str, list[dict[str, Any]]], field: str) -> dict[str, Any]:
    """kvtier / vanilla of ``field``, per pair, with their median and a 95% interval."""
    per_pair = [k[field] / v[field] for k, v in zip(runs["kvtier"], runs["vanilla"], strict=True)]
    interval = median_ci(per_pair)
    return {"pairs": per_pair, "median": interval["median"], "ci95": interval["ci95"]}


RATIO_FIELDS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "output_throughput")


def report(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per dataset: each arm's runs (greedy texts left out), the ratios and text agreement."""
    datasets: dict[str, Any] = {}
    for dataset, arms in runs.items():
        same_text = all(
            k["generated_texts"] == v["generated_texts"]
            for k, v in zip(arms["kvtier"], arms["vanilla"], strict=True)
        )
        datasets[dataset] = {
            "arms": {
                arm: [
                    {key: value for key, value in run.items() if key != "generated_texts"}
                    for run in arm_runs
                ]
                for arm, arm_runs in arms.items()
            },
            "kvtier_over_vanilla": {field: ratios(arms, field) for field in RATIO_FIELDS},
            "kvtier_hit_tokens": [
                run["counters"].get("kvtier_hit_tokens_total", 0.0) for run in arms["kvtier"]
            ],
            "same_greedy_text": same_text,
        }
    return datasets


def run_pairs(
    model: str,
    work: Path,
    pairs: int,
    datasets: Sequence[str],
    num_prompts: int,
    concurrency: int,
    servers: ServerPair = both_servers,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Alternated pairs: a pair of servers from ``servers`` (fresh ones) each, the arm measured
    first swapped each pair."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        dataset: {arm: [] for arm in ARMS} for dataset in datasets
    }
    for pair in range(pairs):
        order = ARMS if pair % 2 == 0 else ARMS[::-1]
        with servers(model, work) as running:
            for dataset in datasets:
                for arm in order:
                    print(f"pair {pair + 1}/{pairs}: {dataset} on {arm}", file=sys.stderr)
                    runs[dataset][arm].append(
                        measure(running[arm], dataset, num_prompts, concurrency)
                    )
    return runs


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="alternated pairs (default 4)")
    parser.add_argument(
        "--num-prompts", type=int, default=64, help="prompts per run and dataset (default 64)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=2, help="requests in flight (default 2)"
    )
    parser.add_argument(
        "--datasets",
        nargs="+",
        choices=DATASETS,
        default=list(DATASETS),
        help="datasets to run (default both)",
    )
    parser.add_argument("--output", type=Path, help="write the JSON here (default stdout)")
    return parser


def main(argv: Sequence[str] | None = None, servers: ServerPair = both_servers) -> int:
    args = arguments().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtier-serve-bench-") as scratch:
        work = Path(scratch)
        model = str(write_tiny_llama(work / "tiny-llama", TinyLlamaSpec()))
        runs = run_pairs(
            model, work, args.pairs, args.datasets, args.num_prompts, args.max_concurrency, servers
        )
    result = {
        "command": "python benchmarks/serve_bench.py " + " ".join(argv or sys.argv[1:]),
        "cpus": os.cpu_count(),
        "server": {"args": SERVER_ARGS, "environment": SERVER_ENVIRONMENT, "kvtier": KVTIER_CONFIG},
        "datasets": report(runs),
    }
    text = json.dumps(result, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
