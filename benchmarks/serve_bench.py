"""vLLM's own serving benchmark (``vllm bench serve``) against vanilla vLLM and ``kvtier serve``.

Each pair starts vLLM's OpenAI server once per arm on 127.0.0.1 (random free ports): vanilla
(``python -m vllm.entrypoints.openai.api_server``) and ``kvtier serve`` with a host tier, all
serving the same random-weight Llama with its tokenizer, with the same small device cache, the
same thread layout (``VLLM_CPU_NUM_OF_RESERVED_CPU`` set alike on all) and the same flags. They
start together, then vLLM's benchmark client (run as a library, unmodified) sends each
prefix-heavy dataset to one after the other, the order rotated from pair to pair, and all are
stopped however the run ends. ``--arms`` adds arms whose host tier is too small for the
prefixes, with a disk tier or a Redis server (started for the pair) below it, under each
prefetch policy (``disk-wait_complete``, ``redis-off``, ...); ``--max-num-seqs`` below
``--max-concurrency`` makes requests queue. Datasets: ``prefix-repetition`` (a few long
prefixes, each shared by several prompts; more prefixes than the device cache holds, so
repeats come back from kvtier) and ``shared-prefix`` (random prompts behind one shared prefix,
which stays in vLLM's own cache: what kvtier costs when it has nothing to add). The JSON report
holds per arm and dataset the client's TTFT mean/median/p99 and throughput, the TTFT of the
prompts that repeat an earlier prompt's prefix apart from the first uses, where the hits came
from (vLLM's cache, the host tier, a lower tier, a prefetch) from the servers' metrics, each
arm's ratios to vanilla (and, for the lower-tier arms, to the ``kvtier`` arm's host-tier hits)
with a 95% interval over the pairs; greedy texts of every arm are compared with vanilla's.

    python benchmarks/serve_bench.py [--pairs 4] [--num-prompts 64] [--arms ...] [--output FILE]

Progress and the client's tables go to stderr; the report to stdout (or ``--output``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
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
from vllm_bench.engine import MODEL as BENCH_MODEL

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
from kvtier.integrations.serve import (
    RESERVED_CPU_VARIABLE,
    VLLM_SERVER_MODULE,
    vanilla_reserved_cpus,
)
from tests.support.redis_server import RedisServer, free_port
from tests.support.served import PortTaken, Server

ARMS = ("vanilla", "kvtier")
"""The default arms: vanilla vLLM, and kvtier with a host tier that holds every prefix."""
PREFETCH_POLICIES = ("off", "wait_complete", "timeout", "best_effort")
LOWER_TIER_ARMS = tuple(
    f"{tier}-{policy}" for tier in ("disk", "redis") for policy in PREFETCH_POLICIES
)
"""Arms with a host tier too small for the prefixes and a disk tier or Redis below it, named
``<tier>-<prefetch policy>``."""
ALL_ARMS = (*ARMS, *LOWER_TIER_ARMS)
SMALL_HOST_BLOCKS = 48
"""The lower-tier arms' host tier, in blocks of the model: fewer than a run's prefixes, more
than the requests queued at once."""
MODELS = {"tiny": TinyLlamaSpec(), "bench": BENCH_MODEL}
"""``--model``: the 557,696-parameter Llama (2 layers), or the vLLM benchmarks' (4 layers, hidden
512, 2 KV heads: 10 million parameters), each with random weights and a trained tokenizer."""
PREFETCH_TIMEOUT_S = 0.1
BLOCK = 32
PREFIX_TOKENS = 256
SUFFIX_TOKENS = 32
OUTPUT_TOKENS = 16
"""Tokens each request generates, unless ``--output-tokens`` says otherwise."""
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


@dataclasses.dataclass(frozen=True)
class Load:
    """What the client sends each run: prompts, requests in flight, tokens each generates."""

    num_prompts: int
    concurrency: int
    output_tokens: int = OUTPUT_TOKENS
    uses_per_prefix: int = 2
    """``prefix-repetition``: prompts per prefix."""


def dataset_args(name: str, load: Load) -> list[str]:
    """``vllm bench serve`` arguments of one of the two datasets."""
    if name == "prefix-repetition":
        return [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(PREFIX_TOKENS),
            "--prefix-repetition-suffix-len",
            str(SUFFIX_TOKENS),
            # Each prefix twice (by default), in shuffled order; 8 blocks each, so the device
            # cache keeps fewer than 4 of them and most later uses find theirs evicted.
            "--prefix-repetition-num-prefixes",
            str(max(1, load.num_prompts // load.uses_per_prefix)),
            "--prefix-repetition-output-len",
            str(load.output_tokens),
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
            str(load.output_tokens),
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


def kvtier_config(arm: str, disk: Path | str, redis_url: str | None, model: TinyLlamaSpec) -> str:
    """The kvtier config of an arm: ``kvtier``'s, or a lower-tier arm's (its own ``disk``
    directory, or its own namespace in the shared Redis, so arms never see each other's
    records)."""
    if arm in ARMS:
        return KVTIER_CONFIG
    tier, policy = arm.split("-", 1)
    lines = [
        f"cpu_bytes: {SMALL_HOST_BLOCKS * model.kv_bytes_per_token(4) * BLOCK}",  # float32
        "store_mode: eager",
        f"namespace: {arm}",
        "prefetch:",
        f"  policy: '{policy}'",
    ]
    if policy == "timeout":
        lines.append(f"  timeout_s: {PREFETCH_TIMEOUT_S}")
    if tier == "disk":
        lines += ["tiers:", f"  - {{type: disk, path: '{disk}', capacity_bytes: 256MiB}}"]
    else:
        lines += ["tiers:", f"  - {{type: redis, url: '{redis_url}'}}"]
    return "\n".join(lines) + "\n"


def start(
    arm: str,
    model: str,
    work: Path,
    redis_url: str | None = None,
    server_args: Sequence[str] = (),
    spec: TinyLlamaSpec = MODELS["tiny"],
) -> Server:
    port = free_port()
    config = work / f"kvtier-{arm}-{port}.yaml"
    disk = work / f"disk-{arm}-{port}"
    if arm.startswith("disk-"):
        disk.mkdir()
    config.write_text(kvtier_config(arm, disk, redis_url, spec))
    command = [*server_command(arm, model, port, config), *server_args]
    return Server.start(command, work / f"{arm}-{port}.log", port, model, SERVER_ENVIRONMENT)


@contextlib.contextmanager
def arm_servers(
    model: str,
    work: Path,
    arms: Sequence[str],
    server_args: Sequence[str] = (),
    spec: TinyLlamaSpec = MODELS["tiny"],
) -> Iterator[dict[str, Server]]:
    """The arms' servers (and a Redis server for the ``redis-`` arms), started together so their
    start-ups overlap; stopped on exit. A server whose port another process took first starts
    again on another port."""
    started: dict[str, Server] = {}
    redis = None
    try:
        if any(arm.startswith("redis-") for arm in arms):
            redis = RedisServer(work / f"redis-{time.monotonic_ns()}").start()
        redis_url = redis.url if redis is not None else None
        for arm in arms:
            started[arm] = start(arm, model, work, redis_url, server_args, spec)
        deadline = time.monotonic() + START_TIMEOUT_S
        for arm in arms:
            while True:
                try:
                    started[arm].wait_ready(deadline)
                    break
                except PortTaken:
                    started[arm] = start(arm, model, work, redis_url, server_args, spec)
        yield started
    finally:
        for server in started.values():
            server.stop()
        if redis is not None:
            redis.stop()


def both_servers(model: str, work: Path) -> contextlib.AbstractContextManager[dict[str, Server]]:
    """The default arms' servers (:data:`ARMS`), as :func:`arm_servers` starts them."""
    return arm_servers(model, work, ARMS)


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


def bench_serve(server: Server, dataset: str, load: Load) -> tuple[dict[str, Any], list[str]]:
    """One run of vLLM's benchmark client against ``server``: its result dictionary, and the
    prompts it sent, in the order of the result's per-request lists."""
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
            str(load.num_prompts),
            "--max-concurrency",
            str(load.concurrency),
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
            *dataset_args(dataset, load),
        ]
    )
    prompts: list[str] = []
    sample = bench.get_samples

    def sample_and_keep(*sample_args: Any) -> Any:
        samples = sample(*sample_args)
        prompts.extend(request.prompt for request in samples)
        return samples

    bench.get_samples = sample_and_keep  # only to see the prompts; the client runs as it is
    try:
        with contextlib.redirect_stdout(sys.stderr):
            result: dict[str, Any] = bench.main(args)
    finally:
        bench.get_samples = sample
    return result, prompts


PREFIX_CHARACTERS = 64
"""Characters at the start of a prompt that tell its prefix: the text of its first tokens,
random in every prefix of both datasets and the same in every prompt that shares one."""


def repeat_ttfts(
    prompts: Sequence[str], ttfts: Sequence[float], errors: Sequence[str]
) -> dict[str, Any]:
    """TTFT apart for the prompts whose prefix an earlier prompt of the run used (the only
    ones a prefix cache can serve: ``repeat``) and for the others (``first_use``), in ms:
    ``count``, ``mean``, ``median`` over the requests that succeeded."""
    seen: set[str] = set()
    split: dict[str, list[float]] = {"repeat": [], "first_use": []}
    for prompt, ttft, error in zip(prompts, ttfts, errors, strict=True):
        prefix = prompt[:PREFIX_CHARACTERS]
        if not error:
            split["repeat" if prefix in seen else "first_use"].append(ttft * 1000)
        seen.add(prefix)
    return {
        name: {
            "count": len(values),
            "mean": statistics.fmean(values) if values else None,
            "median": statistics.median(values) if values else None,
        }
        for name, values in split.items()
    }


RUN_FIELDS = (
    "completed",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
)


def measure(server: Server, dataset: str, load: Load) -> dict[str, Any]:
    """The client's figures for one run, the counters it moved and its greedy texts."""
    before = counters(server)
    result, prompts = bench_serve(server, dataset, load)
    after = counters(server)
    run = {field: result[field] for field in RUN_FIELDS}
    split = repeat_ttfts(prompts, result["ttfts"], result["errors"])
    run["repeat_mean_ttft_ms"] = split["repeat"]["mean"]
    run["repeat_median_ttft_ms"] = split["repeat"]["median"]
    run["ttft_by_prefix_use"] = split
    run["failed"] = load.num_prompts - result["completed"]
    run["counters"] = {name: after[name] - before.get(name, 0.0) for name in after}
    run["generated_texts"] = result["generated_texts"]
    return run


def ratios(
    runs: dict[str, list[dict[str, Any]]], field: str, arm: str, base: str
) -> dict[str, Any]:
    """``arm`` / ``base`` of ``field``, per pair, with their median and a 95% interval (pairs
    in which either is ``None``, such as runs without a repeated prefix, left out)."""
    per_pair = [
        a[field] / b[field]
        for a, b in zip(runs[arm], runs[base], strict=True)
        if a[field] is not None and b[field] is not None
    ]
    interval = median_ci(per_pair)
    return {"pairs": per_pair, "median": interval["median"], "ci95": interval["ci95"]}


RATIO_FIELDS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "repeat_mean_ttft_ms",
    "repeat_median_ttft_ms",
    "output_throughput",
)

HIT_COUNTERS = {
    "device_hit_tokens": "prefix_cache_hits_total",
    "host_hit_tokens": "kvtier_hit_tokens_total",
    "tier_hit_records": "kvtier_tier_hits_total",
    "promoted_blocks": "kvtier_promoted_blocks_total",
    "prefetched_blocks": "kvtier_prefetched_blocks_total",
    "prefetched_used_blocks": "kvtier_prefetched_used_blocks_total",
    "prefetched_unused_blocks": "kvtier_prefetched_unused_blocks_total",
    "prefetches_expired": "kvtier_prefetches_expired_total",
}
"""Where an arm's hits came from, per run, by the counter that says it: vLLM's own cache, loads
from kvtier's host tier (those read from a lower tier first included), records read from the
lower tier, and what prefetches read and what became of it."""


def report(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per dataset: each arm's runs (greedy texts left out), where its hits came from, its
    ratios to vanilla (and to the ``kvtier`` arm, for the lower-tier arms), text agreement."""
    datasets: dict[str, Any] = {}
    for dataset, arms in runs.items():
        others = [arm for arm in arms if arm != "vanilla"]
        datasets[dataset] = {
            "arms": {
                arm: [
                    {key: value for key, value in run.items() if key != "generated_texts"}
                    for run in arm_runs
                ]
                for arm, arm_runs in arms.items()
            },
            "hits": {
                arm: {
                    name: [run["counters"].get(counter, 0.0) for run in arms[arm]]
                    for name, counter in HIT_COUNTERS.items()
                }
                for arm in others
            },
            "over_vanilla": {
                arm: {field: ratios(arms, field, arm, "vanilla") for field in RATIO_FIELDS}
                for arm in others
            },
            "over_host_tier": {
                arm: {field: ratios(arms, field, arm, "kvtier") for field in RATIO_FIELDS}
                for arm in others
                if arm in LOWER_TIER_ARMS and "kvtier" in arms
            },
            "same_greedy_text": {
                arm: all(
                    a["generated_texts"] == v["generated_texts"]
                    for a, v in zip(arms[arm], arms["vanilla"], strict=True)
                )
                for arm in others
            },
        }
    return datasets


def run_pairs(
    model: str,
    work: Path,
    pairs: int,
    datasets: Sequence[str],
    load: Load,
    servers: ServerPair = both_servers,
    arms: Sequence[str] = ARMS,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Rotated pairs: a set of servers from ``servers`` (fresh ones) each, the arm measured
    first rotated each pair."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        dataset: {arm: [] for arm in arms} for dataset in datasets
    }
    for pair in range(pairs):
        shift = pair % len(arms)
        order = [*arms[shift:], *arms[:shift]]
        with servers(model, work) as running:
            for dataset in datasets:
                for arm in order:
                    print(f"pair {pair + 1}/{pairs}: {dataset} on {arm}", file=sys.stderr)
                    runs[dataset][arm].append(measure(running[arm], dataset, load))
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
        "--output-tokens",
        type=int,
        default=OUTPUT_TOKENS,
        help=f"tokens each request generates (default {OUTPUT_TOKENS})",
    )
    parser.add_argument(
        "--uses-per-prefix",
        type=int,
        default=2,
        help="prefix-repetition: prompts sharing each prefix (default 2)",
    )
    parser.add_argument(
        "--datasets",
        nargs="+",
        choices=DATASETS,
        default=list(DATASETS),
        help="datasets to run (default both)",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        choices=ALL_ARMS,
        default=list(ARMS),
        help="arms to run; vanilla is always one (default: vanilla kvtier)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="vLLM's --max-num-seqs on every server (default: vLLM's); below --max-concurrency "
        "requests queue",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="tiny",
        help="tiny: 557,696 parameters, 2 layers (default); bench: the vLLM benchmarks' model, "
        "10 million parameters, 4 layers",
    )
    parser.add_argument("--output", type=Path, help="write the JSON here (default stdout)")
    return parser


def main(argv: Sequence[str] | None = None, servers: ServerPair | None = None) -> int:
    args = arguments().parse_args(argv)
    spec = MODELS[args.model]
    arms = tuple(dict.fromkeys(["vanilla", *args.arms]))
    server_args = [] if args.max_num_seqs is None else ["--max-num-seqs", str(args.max_num_seqs)]
    if servers is None:

        def servers(model: str, work: Path) -> contextlib.AbstractContextManager[dict[str, Server]]:
            return arm_servers(model, work, arms, server_args, spec)

    with tempfile.TemporaryDirectory(prefix="kvtier-serve-bench-") as scratch:
        work = Path(scratch)
        model = str(write_tiny_llama(work / f"{args.model}-llama", spec))
        load = Load(
            args.num_prompts, args.max_concurrency, args.output_tokens, args.uses_per_prefix
        )
        runs = run_pairs(model, work, args.pairs, args.datasets, load, servers, arms)
    result = {
        "command": "python benchmarks/serve_bench.py " + " ".join(argv or sys.argv[1:]),
        "cpus": os.cpu_count(),
        "model": {"name": args.model, **dataclasses.asdict(spec)},
        "load": dataclasses.asdict(load),
        "server": {
            "args": [*SERVER_ARGS, *server_args],
            "environment": SERVER_ENVIRONMENT,
            "kvtier": {arm: kvtier_config(arm, "<directory>", "<redis>", spec) for arm in arms[1:]},
        },
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
