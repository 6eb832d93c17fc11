"""A served soak: ``kvtier serve`` with host, disk and Redis tiers under load and a fault schedule.

It writes the random-weight Llama of :mod:`kvtier.integrations.checkpoints`, starts a
``redis-server`` (and, with ``--s3``, moto's S3 server behind a proxy that can answer errors),
mounts a size-limited tmpfs for the disk tier when run as root, and starts vanilla vLLM and
``kvtier serve`` with the same flags and the same small device cache. Every prompt the run will
send is answered first by the vanilla server (temperature 0, a fixed output length, the token
ids returned); then the vanilla server stops and the soak begins:

- load: openai-SDK clients send chat and completion requests whose prompts share a few
  prefixes and repeat, half of them streaming, some closing their stream after two chunks;
  every ``BURST_EVERY_S`` a burst of long prompts overflows vLLM's device cache (preemptions);
- faults, one after another and again for long runs: Redis killed and restarted, Redis stopped
  (``SIGSTOP``) and continued, the disk tier's filesystem filled up and freed, a burst of
  requests that disconnect after their first chunk, and with ``--s3`` the S3 server answering
  ``503 SlowDown`` and then stalled;
- every interval (60 s, or 20 s in runs under 10 minutes): requests done, errors by class,
  p50/p99 latency, the server's RSS, open descriptors and threads (its process tree, from
  ``/proc``), the host tier's occupancy, each tier's counters, queue depth and state (up,
  backing off, disabled; ``vllm:kvtier_tier_queued`` and ``vllm:kvtier_tier_state``) and
  vLLM's preemptions.

Checks: no request outlives its deadline; every output equals the vanilla one token for token
(a disconnected stream, the part it read); RSS, descriptors and threads stop growing after the
warm-up; each tier stores or returns records again within two backoff periods
(``2 * MAX_BACKOFF_S``) after its fault ends; per tier, the records handed to it equal those it
stored, dropped and already held, exactly.

    python benchmarks/soak.py --minutes 15 [--s3] [--plot soak.png] [--output soak.json]

``--server vanilla`` is the peer for the growth check: the same prompts, clients, long bursts
and abort bursts served by the vanilla server itself (no tiers, so no tier faults), to tell
the model runner's own RSS growth from kvtier's.

Progress goes to stderr, the JSON report to stdout (or ``--output``); the exit status is 1
when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests.support

import openai
from prometheus_client.parser import text_string_to_metric_families
from serve_bench import BLOCK, SERVER_ENVIRONMENT, START_TIMEOUT_S, server_command

from kvtier.integrations.checkpoints import TinyLlamaSpec, write_tiny_llama
from tests.conftest import mount_tmpfs, unmount
from tests.support.redis_server import RedisServer, free_port
from tests.support.s3_server import MotoS3Server, ThrottlingProxy, aws_test_environment
from tests.support.served import PortTaken, Server

OUTPUT_TOKENS = 12
PREFIXES = 6
PREFIX_BLOCKS = 6
UNIQUE_BLOCKS = 2
TAIL_TOKENS = 7
LONG_PROMPTS = 6
LONG_BLOCKS = 10
"""A burst of long prompts fills vLLM's 32 device blocks with whole prompt blocks, so their
first decoded tokens need blocks that are not there: vLLM preempts."""
BURST = 6
"""Long prompts a burst sends at once: 60 blocks. Most are tier hits, and vLLM admits a hit only
once its blocks are read: in three-minute runs, bursts of four preempted after 2 of 5 bursts
(one run none at all), bursts of six after 4 of 5."""
BURST_EVERY_S = 30.0
CLIENTS = 3
PACE_S = 1.5
"""Each client waits this long from one request's start to the next one's, at least."""
ABORT_BURST = 12
NEW_PER_MINUTE = 70
"""Distinct prompts per minute of the run: each brings new blocks, so the tiers keep being
written (and the disk tier's file keeps growing) all run long."""
DEADLINE_S = 120.0
MAX_BACKOFF_S = 4.0
FAULT_S = 10.0
FAULT_GAP_S = 20.0
DISCONNECT_AFTER_CHUNKS = 2
SAMPLE_S = 1.0
FD_SLACK = 8
THREAD_SLACK = 4
QUIET_S = 30.0
HOST_BYTES = 1 << 20
"""32 records of 32 KiB: the host tier evicts all the time, so the disk tier is written."""
DISK_MIB_PER_MINUTE = 8
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
)
FIRST_TOKEN = 1
"""Prompts use token ids from 1 up: 0 is the tokenizer's end-of-sequence token."""


@dataclass(frozen=True)
class Item:
    """One prompt the run may send: completion token ids, or chat messages."""

    name: str
    prompt: tuple[int, ...] = ()
    messages: tuple[tuple[str, str], ...] = ()

    @property
    def chat(self) -> bool:
        return bool(self.messages)


@dataclass(frozen=True)
class Send:
    """One request of the plan: which item, and how it is read."""

    item: Item
    stream: bool
    disconnect: bool


@dataclass
class Outcome:
    """What one request did: its tokens, or its error's class, and when."""

    item: str
    kind: str
    start: float
    end: float
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    disconnected: bool = False

    @property
    def latency_s(self) -> float:
        return self.end - self.start


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(count)]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 7)))
        for _ in range(count)
    )


def catalogue(seed: int, distinct: int, vocab: int) -> tuple[list[Item], list[Item]]:
    """``distinct`` short items (completions and chats, alternately, over ``PREFIXES`` shared
    prefixes of each kind) and ``LONG_PROMPTS`` long completion items."""
    rng = random.Random(seed)
    prefix_ids = [_tokens(rng, PREFIX_BLOCKS * BLOCK, vocab) for _ in range(PREFIXES)]
    prefix_text = [_words(rng, 50) for _ in range(PREFIXES)]
    items = []
    for number in range(distinct):
        prefix = (number // 2) % PREFIXES
        if number % 2 == 0:
            unique = _tokens(rng, UNIQUE_BLOCKS * BLOCK + TAIL_TOKENS, vocab)
            items.append(Item(f"c{number}", prompt=tuple(prefix_ids[prefix] + unique)))
        else:
            messages = (("system", prefix_text[prefix]), ("user", _words(rng, 25)))
            items.append(Item(f"m{number}", messages=messages))
    longs = [
        Item(f"long{number}", prompt=tuple(_tokens(rng, LONG_BLOCKS * BLOCK, vocab)))
        for number in range(LONG_PROMPTS)
    ]
    return items, longs


def plan(seed: int, items: Sequence[Item]) -> list[Send]:
    """Requests in the order the clients take them: each item once, in order, with a repeat of
    an earlier one after each new one; half streaming, a sixth of those disconnecting."""
    rng = random.Random(seed + 1)
    sends = []
    for number, item in enumerate(items):
        for chosen in (item, items[rng.randrange(0, number + 1)]):
            stream = rng.random() < 0.5
            sends.append(Send(chosen, stream, stream and rng.random() < 1 / 6))
    return sends


def error_class(exc: BaseException) -> str:
    """A short name for why a request failed; ``timeout`` is a request past its deadline."""
    if isinstance(exc, openai.APITimeoutError):
        return "timeout"
    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}"
    if isinstance(exc, openai.APIConnectionError):
        return "connection"
    return type(exc).__name__


def request(client: openai.OpenAI, model: str, send: Send, chunks: int | None = None) -> Outcome:
    """Send one request and read it (a disconnecting stream: ``chunks`` chunks, then close)."""
    item = send.item
    if chunks is None and send.disconnect:
        chunks = DISCONNECT_AFTER_CHUNKS
    common: dict[str, Any] = {
        "model": model,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0.0,
        "stream": send.stream,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    kind = ("chat" if item.chat else "completion") + ("-stream" if send.stream else "")
    outcome = Outcome(item.name, kind, time.monotonic(), 0.0)
    try:
        if item.chat:
            messages = [{"role": role, "content": text} for role, text in item.messages]
            reply: Any = client.chat.completions.create(messages=messages, **common)
        else:
            reply = client.completions.create(prompt=list(item.prompt), **common)
        if not send.stream:
            outcome.token_ids = list(reply.choices[0].token_ids)
        else:
            with contextlib.closing(reply):
                for number, chunk in enumerate(reply, start=1):
                    if chunk.choices:
                        outcome.token_ids.extend(getattr(chunk.choices[0], "token_ids", None) or [])
                    if chunks is not None and number >= chunks:
                        outcome.disconnected = True
                        break
    except Exception as exc:  # every failure is counted by class, none stops the soak
        outcome.error = error_class(exc)
    outcome.end = time.monotonic()
    return outcome


def client_for(server: Server, timeout_s: float = DEADLINE_S) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("/v1"), api_key="soak", timeout=timeout_s, max_retries=0
    )


def references(server: Server, items: Sequence[Item]) -> dict[str, list[int]]:
    """Each item's output token ids from ``server`` (vanilla), non-streaming."""
    client = client_for(server)
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(
            pool.map(lambda i: request(client, server.model, Send(i, False, False)), items)
        )
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        raise RuntimeError(
            f"the vanilla server failed {len(failed)} reference requests: {failed[:3]}"
        )
    return {o.item: o.token_ids for o in outcomes}


# -- the server's process tree and metrics ------------------------------------------------------


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def resources(root: int) -> dict[str, Any]:
    """RSS bytes (all, anonymous, and per process name), open descriptors and threads of
    ``root``'s process tree."""
    totals: dict[str, Any] = {"rss_bytes": 0, "rss_anon_bytes": 0, "fds": 0, "threads": 0}
    by_name: dict[str, int] = {}
    for pid in process_tree(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            totals["fds"] += len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            continue
        name = status.split("\n", 1)[0].split(None, 1)[-1]
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                totals["rss_bytes"] += int(line.split()[1]) * 1024
                by_name[name] = by_name.get(name, 0) + int(line.split()[1]) * 1024
            elif line.startswith("RssAnon:"):
                totals["rss_anon_bytes"] += int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                totals["threads"] += int(line.split()[1])
    totals["rss_by_process"] = by_name
    return totals


TIER_FIELDS = (
    "stores",
    "drops",
    "held",
    "queue_drops",
    "hits",
    "misses",
    "errors",
    "deadline_misses",
)
TOTALS = ("demoted_blocks", "written_through_blocks", "promoted_blocks", "hit_tokens")


TIER_STATES = ("up", "backing off", "disabled")
"""``vllm:kvtier_tier_state``'s values, by number."""


def scrape(server: Server) -> dict[str, Any]:
    """kvtier's counters (per tier where they have one), its host-tier gauges, each tier's
    queue depth and state, and vLLM's preemptions, from the server's ``/metrics``."""
    with urllib.request.urlopen(server.url("/metrics"), timeout=30) as reply:
        return parse_metrics(reply.read().decode())


def parse_metrics(text: str) -> dict[str, Any]:
    """What :func:`scrape` keeps of a ``/metrics`` page, summed over engines (a tier's state:
    the worst)."""
    values: dict[str, Any] = {"tiers": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("vllm:")
            if name.startswith("kvtier_tier_") and name.endswith("_total"):
                counter = name.removeprefix("kvtier_tier_").removesuffix("_total")
                row = values["tiers"].setdefault(sample.labels["tier"], {})
                row[counter] = row.get(counter, 0.0) + sample.value
            elif name == "kvtier_tier_queued":
                row = values["tiers"].setdefault(sample.labels["tier"], {})
                row["queued"] = row.get("queued", 0.0) + sample.value
            elif name == "kvtier_tier_state":
                row = values["tiers"].setdefault(sample.labels["tier"], {})
                row["state"] = max(
                    row.get("state", "up"), TIER_STATES[int(sample.value)], key=TIER_STATES.index
                )
            elif name.removeprefix("kvtier_").removesuffix("_total") in TOTALS and name.endswith(
                "_total"
            ):
                key = name.removeprefix("kvtier_").removesuffix("_total")
                values[key] = values.get(key, 0.0) + sample.value
            elif name in ("kvtier_used_bytes", "kvtier_capacity_bytes"):
                values[name.removeprefix("kvtier_")] = sample.value
            elif name == "num_preemptions_total":
                values["preemptions"] = values.get("preemptions", 0.0) + sample.value
    return values


# -- faults ------------------------------------------------------------------------------------


@dataclass
class Fault:
    """A fault the schedule starts and ends; ``tier`` is the tier it hits, if one."""

    name: str
    tier: str | None
    begin: Callable[[], None]
    end: Callable[[], None]
    duration_s: float = FAULT_S


class DiskFiller:
    """Fills the filesystem under the disk tier, and frees it again."""

    def __init__(self, mount: Path) -> None:
        self._path = mount / "filler"

    def fill(self) -> None:
        descriptor = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            # MiB writes, then pages for what a whole MiB no longer fits in
            for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
                with contextlib.suppress(OSError):
                    while os.write(descriptor, chunk):
                        pass
        finally:
            os.close(descriptor)

    def free(self) -> None:
        self._path.unlink(missing_ok=True)


def signal_process(process: Any, number: int) -> Callable[[], None]:
    return lambda: process.send_signal(number)


def schedule(faults: Sequence[Fault], warmup_s: float, run_s: float) -> list[tuple[float, Fault]]:
    """Faults in turn, ``FAULT_GAP_S`` apart from ``warmup_s`` on, again and again, each
    ending with time to recover before the run does."""
    starts, at = [], warmup_s
    while True:
        for fault in faults:
            if at + fault.duration_s + FAULT_GAP_S > run_s:
                return starts
            starts.append((at, fault))
            at += fault.duration_s + FAULT_GAP_S


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Soak:
    """The running soak's shared state: the plan, the outcomes, the samples."""

    server: Server
    sends: list[Send]
    longs: list[Item]
    started: float
    run_s: float
    outcomes: list[Outcome] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    windows: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_send: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def now(self) -> float:
        return time.monotonic() - self.started

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def take(self) -> Send:
        with self.lock:
            send = self.sends[self.next_send % len(self.sends)]
            self.next_send += 1
        return send

    def client_loop(self) -> None:
        client = client_for(self.server)
        while not self.stop.is_set():
            began = time.monotonic()
            self.record(request(client, self.server.model, self.take()))
            self.stop.wait(max(0.0, PACE_S - (time.monotonic() - began)))

    def burst(self, sends: Sequence[Send], chunks: int | None = None) -> None:
        client = client_for(self.server)
        with ThreadPoolExecutor(len(sends)) as pool:
            for outcome in pool.map(lambda s: request(client, self.server.model, s, chunks), sends):
                self.record(outcome)

    def long_loop(self) -> None:
        number = 0
        while not self.stop.wait(BURST_EVERY_S):
            chosen = [self.longs[(number + i) % len(self.longs)] for i in range(BURST)]
            number += BURST
            self.burst([Send(item, False, False) for item in chosen])

    def abort_burst(self) -> None:
        """Requests that all close their stream after the first chunk."""
        sends = [self.take() for _ in range(ABORT_BURST)]
        self.burst([Send(s.item, True, True) for s in sends], chunks=1)

    def fault_loop(self, timeline: Sequence[tuple[float, Fault]]) -> None:
        for at, fault in timeline:
            if self.stop.wait(max(0.0, at - self.now())):
                return
            begin = self.now()
            print(f"{begin:7.1f} s: fault {fault.name}", file=sys.stderr)
            window = {"fault": fault.name, "tier": fault.tier, "begin_s": begin}
            try:
                fault.begin()
                self.stop.wait(fault.duration_s)
                fault.end()
            except Exception as exc:  # a fault that could not be made is reported, not fatal
                window["error"] = repr(exc)
            window["end_s"] = self.now()
            self.windows.append(window)

    def states(self) -> dict[str, str]:
        """Each tier's state in the latest sample that has one."""
        with self.lock:
            scraped = [s for s in self.samples if "tiers" in s]
        if not scraped:
            return {}
        return {tier: row.get("state", "up") for tier, row in scraped[-1]["tiers"].items()}

    def sample_loop(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        sample = {"t": self.now(), **resources(self.server.process.pid)}
        try:
            sample.update(scrape(self.server))
        except OSError as exc:
            sample["scrape_error"] = str(exc)
        with self.lock:
            self.samples.append(sample)


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def intervals(soak: Soak, interval_s: float) -> list:
    """One row per interval: requests, errors, latencies, resources, and per tier its
    counters, its queue depth and state at the interval's end, the deepest queue and the
    states of the samples in it."""
    rows = []
    scraped = [s for s in soak.samples if "tiers" in s]
    last: dict[str, Any] = {}
    end = interval_s
    while end <= soak.run_s + interval_s / 2 and scraped:
        done = [o for o in soak.outcomes if end - interval_s <= o.end - soak.started < end]
        latencies = [o.latency_s for o in done if o.error is None and not o.disconnected]
        sample = min(scraped, key=lambda s: abs(s["t"] - end))
        # the interval's samples, and the one its row reports at its end (which may follow it)
        within = [s for s in scraped if end - interval_s <= s["t"] < end] + [sample]
        tiers = {}
        for tier, counts in sample["tiers"].items():
            before = last.get("tiers", {}).get(tier, {})
            tiers[tier] = {
                **{f: counts.get(f, 0.0) - before.get(f, 0.0) for f in TIER_FIELDS},
                "queued": counts.get("queued", 0.0),
                "queued_max": max(s["tiers"].get(tier, {}).get("queued", 0.0) for s in within),
                "state": counts.get("state", "up"),
                "states_seen": sorted(
                    {s["tiers"].get(tier, {}).get("state", "up") for s in within},
                    key=TIER_STATES.index,
                ),
            }
        rows.append(
            {
                "t_s": round(sample["t"], 1),
                "requests": len(done),
                "errors": dict(Counter(o.error for o in done if o.error is not None)),
                "disconnected": sum(o.disconnected for o in done),
                "p50_s": percentile(latencies, 0.5),
                "p99_s": percentile(latencies, 0.99),
                "rss_mib": round(sample["rss_bytes"] / (1 << 20), 1),
                "rss_mib_by_process": {
                    name: round(value / (1 << 20), 1)
                    for name, value in sample["rss_by_process"].items()
                },
                "fds": sample["fds"],
                "threads": sample["threads"],
                "read_buffers_mib": round(read_buffer_bytes(sample) / (1 << 20), 1),
                "host_used": sample.get("used_bytes", 0.0)
                / max(1.0, sample.get("capacity_bytes", 1.0)),
                "preemptions": sample.get("preemptions", 0.0) - last.get("preemptions", 0.0),
                "tiers": tiers,
            }
        )
        last = sample
        end += interval_s
    return rows


def stores(sample: dict[str, Any], tier: str) -> float:
    return sample.get("tiers", {}).get(tier, {}).get("stores", 0.0)


def recoveries(soak: Soak) -> list[dict[str, Any]]:
    """For each fault on a tier: seconds from its end to the first sample showing the tier
    storing records again (``None``: not before the next fault or the end). Stores, not
    hits: a disk that is full still reads."""
    scraped = [s for s in soak.samples if "tiers" in s]
    found = []
    for window in soak.windows:
        if window["tier"] is None:
            continue
        after = [s for s in scraped if s["t"] >= window["end_s"]]
        later = [w["begin_s"] for w in soak.windows if w["begin_s"] > window["end_s"]]
        horizon = min(later, default=soak.run_s)
        recovered = None
        if after:
            base = stores(after[0], window["tier"])
            recovered = next(
                (
                    s["t"] - window["end_s"]
                    for s in after
                    if s["t"] <= horizon and stores(s, window["tier"]) > base
                ),
                None,
            )
        bound = 2 * MAX_BACKOFF_S
        found.append(
            {
                **window,
                "recovered_after_s": recovered,
                "bound_s": bound,
                "ok": recovered is not None and recovered <= bound + SAMPLE_S,
            }
        )
    return found


def compare(outcomes: Sequence[Outcome], reference: dict[str, list[int]]) -> dict[str, Any]:
    """Outputs against the vanilla ones: equal, or a prefix of them for a closed stream."""
    wrong = []
    checked = 0
    for o in outcomes:
        if o.error is not None:
            continue
        want = reference[o.item]
        checked += 1
        same = o.token_ids == want[: len(o.token_ids)] if o.disconnected else o.token_ids == want
        if not same:
            wrong.append({"item": o.item, "kind": o.kind, "got": o.token_ids, "want": want})
    return {"checked": checked, "wrong": len(wrong), "examples": wrong[:5], "ok": not wrong}


def growth(samples: Sequence[dict[str, Any]], warmup_s: float, rss_limit: float) -> dict[str, Any]:
    """RSS, descriptors and threads from the first sample after the warm-up to the last: RSS
    may grow by ``rss_limit`` (a share), descriptors by ``FD_SLACK``, threads by
    ``THREAD_SLACK``."""
    after = [s for s in samples if s["t"] >= warmup_s]
    if len(after) < 2:
        return {"ok": False, "reason": "no samples after the warm-up"}
    first, last = after[0], after[-1]

    def mib(sample: dict[str, Any], key: str) -> float:
        return round(sample[key] / (1 << 20), 1)

    rss = (last["rss_bytes"] - first["rss_bytes"]) / first["rss_bytes"]
    buffers = read_buffer_bytes(last) - read_buffer_bytes(first)
    return {
        "rss_mib": [mib(first, "rss_bytes"), mib(last, "rss_bytes")],
        "rss_anon_mib": [mib(first, "rss_anon_bytes"), mib(last, "rss_anon_bytes")],
        "rss_growth": rss,
        "read_buffers_mib": [round(read_buffer_bytes(s) / (1 << 20), 1) for s in (first, last)],
        "rss_growth_less_read_buffers": rss - buffers / first["rss_bytes"],
        "fds": [first["fds"], last["fds"]],
        "threads": [first["threads"], last["threads"]],
        "peak_fds": max(s["fds"] for s in after),
        "peak_threads": max(s["threads"] for s in after),
        "ok": rss <= rss_limit
        and last["fds"] - first["fds"] <= FD_SLACK
        and last["threads"] - first["threads"] <= THREAD_SLACK,
    }


def read_buffer_bytes(sample: dict[str, Any]) -> float:
    """Bytes of the buffers every tier keeps for reads (kvtier's memory that only grows)."""
    return sum(row.get("read_buffer_bytes", 0.0) for row in sample.get("tiers", {}).values())


def balances(server: Server, tiers: dict[str, str]) -> dict[str, Any]:
    """Per tier, records handed to it (the demoted blocks for the write-back tier, the
    written-through ones for the others) against those it stored, dropped and already held,
    once the counters stopped moving: every tier must balance exactly, and what does not is
    reported as ``uncounted``."""
    previous, deadline = None, time.monotonic() + QUIET_S
    while time.monotonic() < deadline:
        counts = scrape(server)
        if counts == previous:
            break
        previous = counts
        time.sleep(3)
    counts = previous or scrape(server)
    return {tier: balance(counts, tier, policy) for tier, policy in tiers.items()}


def balance(counts: dict[str, Any], tier: str, policy: str) -> dict[str, Any]:
    """One tier's records handed against stored + dropped + held, from one scrape."""
    given = counts.get(
        "demoted_blocks" if policy == "write_back" else "written_through_blocks", 0.0
    )
    row = counts["tiers"].get(tier, {})
    taken = row.get("stores", 0.0) + row.get("drops", 0.0) + row.get("held", 0.0)
    return {
        "handed": given,
        "stored": row.get("stores", 0.0),
        "dropped": row.get("drops", 0.0),
        "held": row.get("held", 0.0),
        "uncounted": given - taken,
        "ok": taken == given,
    }


def kvtier_config(disk: Path, disk_bytes: int, redis_url: str, s3: dict[str, str] | None) -> str:
    tiers = [
        {"type": "disk", "path": str(disk), "capacity_bytes": disk_bytes, "preallocate": False},
        {"type": "redis", "url": redis_url, "reconnect_max_backoff_s": MAX_BACKOFF_S},
    ]
    if s3 is not None:
        tiers.append(
            {
                "type": "s3",
                "addressing_style": "path",
                "reconnect_max_backoff_s": MAX_BACKOFF_S,
                **s3,
            }
        )
    return json.dumps({"cpu_bytes": HOST_BYTES, "store_mode": "eager", "tiers": tiers})


def launch(arm: str, model: str, work: Path, env: dict[str, str]) -> Server:
    """Start vanilla vLLM or ``kvtier serve`` (its config in ``work/kvtier.yaml``) on a free
    port, with the chat template the prompts need."""
    port = free_port()
    command = [
        *server_command(arm, model, port, work / "kvtier.yaml"),
        "--chat-template",
        CHAT_TEMPLATE,
    ]
    return Server.start(
        command, work / f"{arm}-{port}.log", port, model, {**SERVER_ENVIRONMENT, **env}
    )


def ready(server: Server, again: Callable[[], Server]) -> Server:
    """``server`` once it answers, or one ``again`` started if another process took its port."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            server.wait_ready(deadline)
            return server
        except PortTaken:
            server = again()


@contextlib.contextmanager
def disk_mount(work: Path, size_bytes: int) -> Iterator[tuple[Path, bool]]:
    """The disk tier's filesystem: a tmpfs of ``size_bytes`` when this process may mount one
    (root), else a directory of ``work``'s filesystem, which the soak does not fill."""
    mount = work / "disk"
    mounted = mount_tmpfs(mount, size_bytes)
    try:
        yield mount, mounted
    finally:
        if mounted:
            unmount(mount)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_s = args.minutes * 60.0
    interval_s = 60.0 if args.minutes >= 10 else 20.0
    warmup_s = min(300.0, run_s / 4)
    model = str(write_tiny_llama(work / "tiny-llama", TinyLlamaSpec()))
    items, longs = catalogue(
        args.seed, max(8, round(args.minutes * NEW_PER_MINUTE)), TinyLlamaSpec().vocab_size
    )
    sends = plan(args.seed, items)
    disk_bytes = max(16, round(args.minutes * DISK_MIB_PER_MINUTE)) << 20
    with contextlib.ExitStack() as stack:
        redis = RedisServer(work / "redis").start()
        stack.callback(redis.stop)
        s3_settings, s3_env, moto, proxy = None, {}, None, None
        if args.s3:
            moto = MotoS3Server().start()
            stack.callback(moto.stop)
            moto.create_bucket("soak")
            proxy = ThrottlingProxy(moto.port)
            stack.callback(proxy.stop)
            s3_settings = {"bucket": "soak", "endpoint_url": proxy.url, "region": "us-east-1"}
            s3_env = aws_test_environment()
        disk_root, full_possible = stack.enter_context(disk_mount(work, disk_bytes + (8 << 20)))
        config = kvtier_config(disk_root / "tier", disk_bytes, redis.url, s3_settings)
        (work / "kvtier.yaml").write_text(config)
        arms = ("vanilla", "kvtier") if args.server == "kvtier" else ("vanilla",)
        print(f"starting {' and '.join(arms)}", file=sys.stderr)
        envs = {"vanilla": {}, "kvtier": s3_env}
        starts = {arm: functools.partial(launch, arm, model, work, envs[arm]) for arm in arms}
        servers = {arm: start() for arm, start in starts.items()}
        stack.callback(lambda: [server.stop() for server in servers.values()])
        servers["vanilla"] = ready(servers["vanilla"], starts["vanilla"])
        wanted = {s.item.name: s.item for s in sends} | {i.name: i for i in longs}
        began = time.monotonic()
        reference = references(servers["vanilla"], list(wanted.values()))
        reference_s = time.monotonic() - began
        print(f"{len(reference)} reference outputs in {reference_s:.0f} s", file=sys.stderr)
        if args.server == "kvtier":
            servers["vanilla"].stop()
            server = servers["kvtier"] = ready(servers["kvtier"], starts["kvtier"])
            tiers = {"disk": "write_back", "redis": "write_through"} | (
                {"s3": "write_through"} if args.s3 else {}
            )
            faults = [
                Fault("redis_kill", "redis", redis.kill, redis.start),
                Fault("redis_stall", "redis", redis.pause, redis.resume),
            ]
        else:  # the peer: the same load on vanilla vLLM, whose only fault is the abort burst
            server, tiers, faults = servers["vanilla"], {}, []
        if full_possible and tiers:
            filler = DiskFiller(disk_root)
            faults.append(Fault("disk_full", "disk", filler.fill, filler.free))
        faults.append(Fault("abort_burst", None, lambda: None, lambda: None, 0.0))
        if moto is not None and proxy is not None and tiers:
            faults.append(
                Fault("s3_errors", "s3", lambda: proxy.throttle(1 << 30), lambda: proxy.throttle(0))
            )
            faults.append(
                Fault(
                    "s3_stall",
                    "s3",
                    signal_process(moto.process, signal.SIGSTOP),
                    signal_process(moto.process, signal.SIGCONT),
                )
            )
        timeline = schedule(faults, warmup_s, run_s)
        soak = Soak(server, sends, longs, time.monotonic(), run_s)
        abort = next(f for f in faults if f.name == "abort_burst")
        abort.begin = soak.abort_burst
        threads = [
            threading.Thread(target=soak.client_loop, name=f"client{n}") for n in range(CLIENTS)
        ]
        threads += [
            threading.Thread(target=soak.long_loop, name="long"),
            threading.Thread(target=soak.fault_loop, args=(timeline,), name="faults"),
            threading.Thread(target=soak.sample_loop, name="samples"),
        ]
        for thread in threads:
            thread.start()
        with contextlib.suppress(KeyboardInterrupt):
            reported = 0.0
            while soak.now() < run_s:
                time.sleep(1)
                if soak.now() - reported >= interval_s:
                    reported = soak.now()
                    print(
                        f"{reported:7.1f} s: {len(soak.outcomes)} requests, states {soak.states()}",
                        file=sys.stderr,
                    )
        soak.stop.set()
        for thread in threads:
            thread.join(DEADLINE_S + 30)
        hung = [t.name for t in threads if t.is_alive()]
        exited = server.process.poll()
        soak.sample()
        counters = balances(server, tiers)
        rows = intervals(soak, interval_s)
    late = [o for o in soak.outcomes if o.latency_s > DEADLINE_S or o.error == "timeout"]
    outputs = compare(soak.outcomes, reference)
    grown = growth(soak.samples, warmup_s, args.rss_growth)
    recovered = recoveries(soak)
    checks = {
        "no_hang": {
            "late_requests": len(late),
            "stuck_threads": hung,
            "server_exit_status": exited,
            "ok": not late and not hung and exited is None,
        },
        "outputs": outputs,
        "growth": grown,
        "recovery": {"faults": recovered, "ok": all(r["ok"] for r in recovered)},
        "counters": {"tiers": counters, "ok": all(r["ok"] for r in counters.values())},
    }
    errors = Counter(o.error for o in soak.outcomes if o.error is not None)
    return {
        "command": "python benchmarks/soak.py " + " ".join(args.argv),
        "cpus": os.cpu_count(),
        "minutes": args.minutes,
        "server": args.server,
        "interval_s": interval_s,
        "warmup_s": warmup_s,
        "disk_full": "tmpfs filled" if full_possible else "skipped: not root, no tmpfs to fill",
        "reference": {"outputs": len(reference), "seconds": round(reference_s, 1)},
        "requests": len(soak.outcomes),
        "errors": dict(errors),
        "faults": soak.windows,
        "intervals": rows,
        "checks": checks,
        "ok": all(check["ok"] for check in checks.values()),
    }


def plot(report: dict[str, Any], path: Path) -> None:
    """The per-interval series in one figure, fault windows shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["intervals"]
    t = [r["t_s"] / 60 for r in rows]
    panels = [
        (
            "requests per interval",
            {
                "done": [r["requests"] for r in rows],
                "errors": [sum(r["errors"].values()) for r in rows],
            },
        ),
        ("latency (s)", {"p50": [r["p50_s"] for r in rows], "p99": [r["p99_s"] for r in rows]}),
        (
            "server RSS (MiB)",
            {
                name: [r["rss_mib_by_process"].get(name) for r in rows]
                for name in rows[0]["rss_mib_by_process"]
            }
            if rows
            else {},
        ),
        (
            "descriptors, threads",
            {"fds": [r["fds"] for r in rows], "threads": [r["threads"] for r in rows]},
        ),
        ("host tier used (share)", {"host": [r["host_used"] for r in rows]}),
        (
            "tier stores per interval",
            {
                tier: [r["tiers"].get(tier, {}).get("stores", 0) for r in rows]
                for tier in rows[0]["tiers"]
            }
            if rows
            else {},
        ),
        (
            "deepest tier queue per interval (requests)",
            {
                tier: [r["tiers"].get(tier, {}).get("queued_max", 0) for r in rows]
                for tier in rows[0]["tiers"]
            }
            if rows
            else {},
        ),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.2 * len(panels)), sharex=True)
    for axis, (title, series) in zip(axes, panels, strict=True):
        for label, values in series.items():
            axis.plot(t, values, marker="o", label=label)
        for window in report["faults"]:
            axis.axvspan(
                window["begin_s"] / 60,
                max(window["end_s"], window["begin_s"] + 2) / 60,
                color="red",
                alpha=0.15,
            )
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
    axes[-1].set_xlabel("minutes (red: a fault)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="soak length (default 15)")
    parser.add_argument("--s3", action="store_true", help="add an S3 tier (moto) and its faults")
    parser.add_argument(
        "--server",
        choices=("kvtier", "vanilla"),
        default="kvtier",
        help="serve the soak with kvtier (default) or, as the peer for growth, vanilla vLLM "
        "under the same load and abort bursts (no tiers, no tier faults)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and plan seed (default 0)")
    parser.add_argument(
        "--rss-growth",
        type=float,
        default=0.01,
        help="RSS growth allowed after the warm-up (default 0.01)",
    )
    parser.add_argument("--plot", type=Path, help="write the per-interval plot here (PNG)")
    parser.add_argument("--output", type=Path, help="write the JSON here (default stdout)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = arguments().parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as scratch:
        report = run(args, Path(scratch))
    text = json.dumps(report, indent=2)
    if args.output:
        args.output.write_text(text + "\n")
    else:
        print(text)
    if args.plot:
        plot(report, args.plot)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
