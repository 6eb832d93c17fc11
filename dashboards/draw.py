"""Draw every panel of kvtier's Grafana dashboard from scrapes of a short vLLM run.

Runs a short shared-prefix workload on vLLM (CPU) with kvtier, scrapes vLLM's
Prometheus registry after each round, evaluates the dashboard's own queries
over the scrapes (:mod:`promql`, next to this file) and draws every panel
into one PNG, the picture of ``docs/metrics.md``::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python dashboards/draw.py docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from promql import DASHBOARD, Labels, Scrape, evaluate, legend, load_dashboard, parse

_UNITS = {"percentunit": (100.0, "%"), "s": (1000.0, "ms"), "Bps": (1 / 1024, "KiB/s")}


def draw(
    dashboard: Mapping[str, Any], scrapes: Sequence[Scrape], window_s: float, out: Path
) -> None:
    """Draw every panel of ``dashboard`` from ``scrapes`` into the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    columns = 3
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.0 * rows), squeeze=False)
    start = scrapes[0].seconds
    times = [each.seconds - start for each in scrapes]
    for axis, panel in zip(axes.flat, panels, strict=False):
        scale, unit = _UNITS.get(panel["fieldConfig"]["defaults"].get("unit", ""), (1.0, ""))
        for target in panel["targets"]:
            node = parse(target["expr"])
            lines: dict[Labels, list[float]] = {}
            for index in range(len(scrapes)):
                value = evaluate(node, scrapes, index, window_s)
                vector = {frozenset(): value} if isinstance(value, float) else value
                for labels, number in vector.items():
                    lines.setdefault(labels, [math.nan] * len(scrapes))[index] = number * scale
            for labels, values in sorted(lines.items(), key=lambda item: sorted(item[0])):
                axis.plot(times, values, marker=".", label=legend(target["legendFormat"], labels))
        axis.set_title(panel["title"], fontsize=10)
        axis.set_xlabel("seconds", fontsize=8)
        if unit:
            axis.set_ylabel(unit, fontsize=8)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=7, loc="upper left")
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    figure.suptitle(dashboard["title"], fontsize=12)
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


def scrape(registry: Any, seconds: float) -> Scrape:
    """Every sample of a ``prometheus_client`` registry, stamped ``seconds``."""
    samples = {}
    for family in registry.collect():
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return Scrape(seconds, samples)


def record_run(rounds: int, seed: int = 0) -> list[Scrape]:
    """Run shared-prefix rounds on an in-process vLLM (CPU) with kvtier; scrape after each.

    Each round sends a batch of prompts that share one of a few prefixes, then
    empties vLLM's own prefix cache, so the next round's shared prefixes come
    from kvtier's host tier; the host tier holds fewer blocks than the prefixes,
    so it evicts to a disk tier below it, which serves the host tier's misses.
    """
    # vLLM reads these when it is imported, so it is imported after them.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from prometheus_client import REGISTRY
    from vllm import LLM

    from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
    from kvtier.integrations.vllm.offline import (
        engine_kwargs,
        generate,
        reset_device_cache,
        shutdown,
    )

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(200, 500))] for _ in range(8)]
    with tempfile.TemporaryDirectory() as folder:
        model_dir = write_tiny_llama(Path(folder), TinyLlamaSpec())
        disk = {"type": "disk", "path": str(Path(folder) / "tier"), "capacity_bytes": "64MiB"}
        kvtier = {"cpu_bytes": "1MiB", "tiers": [disk]}
        kwargs = engine_kwargs(model_dir, kvtier=kvtier, num_device_blocks=256)
        llm = LLM(**kwargs)
        try:
            scrapes = [scrape(REGISTRY, time.monotonic())]
            for _ in range(rounds):
                prompts = [
                    rng.choice(prefixes)[: rng.randrange(64, 500)]
                    + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
                    for _ in range(rng.randrange(4, 12))
                ]
                generate(llm, prompts, max_tokens=4)
                reset_device_cache(llm)
                scrapes.append(scrape(REGISTRY, time.monotonic()))
        finally:
            shutdown(llm)
    return scrapes


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="PNG file to write")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD, help="default: %(default)s")
    parser.add_argument("--rounds", type=int, default=24, help="default: %(default)s")
    parser.add_argument(
        "--window-rounds",
        type=int,
        default=4,
        help="rounds that $__rate_interval spans (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    dashboard = load_dashboard(args.dashboard)
    scrapes = record_run(args.rounds)
    step = (scrapes[-1].seconds - scrapes[0].seconds) / max(1, len(scrapes) - 1)
    draw(dashboard, scrapes, args.window_rounds * step, args.out)


if __name__ == "__main__":
    main()
