"""Deterministic synthetic serving traces in the Mooncake format, to judge policies on more traces.

Two workloads, each a function of its seed only:

- ``chat``: multi-turn conversations. Each conversation starts from one of a
  few shared system prompts (Zipf-popular) and every turn resends the previous
  turn's prompt plus the reply and a new user message, so a turn extends the
  previous turn's chain. Conversations interleave, with think time between turns.
- ``rag``: retrieval-augmented and few-shot requests: a Zipf-popular few-shot
  template, then a Zipf-popular document from a large pool, then a short unique
  question. Reuse is of shared prefixes of varying depth, at long gaps.
- ``agent``: tool-calling agents. Each task starts from one of a few long
  shared system prompts (tens of blocks, Zipf-popular) and a task description,
  then loops: every step resends the whole context plus the last tool call and
  its result (sometimes a large one), so contexts grow to hundreds of blocks.
  A step sometimes retries from an earlier point of its own context (a branch),
  and several tasks run at once with short gaps between their steps.

Block ids are assigned through a prefix trie, so equal ids mean equal
prefixes, as in the Mooncake traces (512 tokens per id).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from typing import Any, Literal

from kvtier.simulator.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, mooncake_request

Workload = Literal["chat", "rag", "agent"]
WORKLOADS: tuple[Workload, ...] = ("chat", "rag", "agent")


class _PrefixIds:
    """Numbers blocks so that a block's id depends on its content and its whole prefix."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[Any, ...]], int] = {}
        self._next = itertools.count()

    def chain(self, labels: Iterable[tuple[Any, ...]], parent: int = -1) -> list[int]:
        ids = []
        for label in labels:
            node = self._ids.get((parent, label))
            if node is None:
                node = self._ids[(parent, label)] = next(self._next)
            ids.append(node)
            parent = node
        return ids


def _zipf_weights(count: int, alpha: float) -> list[float]:
    """Cumulative Zipf weights of ranks ``1..count``, for ``random.choices``."""
    weights = [1.0 / (rank**alpha) for rank in range(1, count + 1)]
    return list(itertools.accumulate(weights))


def _chat(rng: random.Random, num_requests: int) -> list[dict[str, Any]]:
    ids = _PrefixIds()
    system_prompts = [rng.randint(2, 8) for _ in range(20)]
    system_weights = _zipf_weights(len(system_prompts), 1.0)
    conversation_ids = itertools.count()
    active: list[dict[str, Any]] = []
    records = []
    clock_ms = 0.0
    for _ in range(num_requests):
        clock_ms += rng.expovariate(1 / 250)
        if not active or rng.random() < 0.25 or len(active) < 64 and rng.random() < 0.5:
            system = rng.choices(range(len(system_prompts)), cum_weights=system_weights)[0]
            labels = [("system", system, block) for block in range(system_prompts[system])]
            active.append(
                {"id": next(conversation_ids), "labels": labels, "turns": rng.randint(1, 12)}
            )
        conversation = rng.choice(active)
        turn = len(conversation["labels"])
        conversation["labels"] = conversation["labels"] + [
            ("turn", conversation["id"], turn, block) for block in range(rng.randint(1, 6))
        ]
        hash_ids = ids.chain(conversation["labels"])
        records.append(_record(clock_ms, hash_ids, rng))
        conversation["turns"] -= 1
        if conversation["turns"] == 0:
            active.remove(conversation)
    return records


def _rag(rng: random.Random, num_requests: int) -> list[dict[str, Any]]:
    ids = _PrefixIds()
    templates = [rng.randint(1, 10) for _ in range(12)]
    template_weights = _zipf_weights(len(templates), 1.2)
    documents = [rng.randint(4, 48) for _ in range(6000)]
    document_weights = _zipf_weights(len(documents), 0.9)
    records = []
    clock_ms = 0.0
    for number in range(num_requests):
        clock_ms += rng.expovariate(1 / 250)
        template = rng.choices(range(len(templates)), cum_weights=template_weights)[0]
        document = rng.choices(range(len(documents)), cum_weights=document_weights)[0]
        labels = [("template", template, block) for block in range(templates[template])]
        labels += [("document", document, block) for block in range(documents[document])]
        labels += [("question", number, block) for block in range(rng.randint(1, 2))]
        records.append(_record(clock_ms, ids.chain(labels), rng))
    return records


def _agent(rng: random.Random, num_requests: int) -> list[dict[str, Any]]:
    ids = _PrefixIds()
    system_prompts = [rng.randint(16, 64) for _ in range(12)]
    system_weights = _zipf_weights(len(system_prompts), 1.1)
    task_ids = itertools.count()
    active: list[dict[str, Any]] = []
    paused: list[dict[str, Any]] = []
    records = []
    clock_ms = 0.0
    for _ in range(num_requests):
        clock_ms += rng.expovariate(1 / 100)
        if not active or len(active) < 64 and rng.random() < 0.3:
            if paused and rng.random() < 0.2:
                # A finished task resumed later (the user comes back to it): its context returns.
                resumed = paused.pop(rng.randrange(len(paused)))
                resumed["steps"] = rng.randint(1, 10)
                active.append(resumed)
            else:
                system = rng.choices(range(len(system_prompts)), cum_weights=system_weights)[0]
                task = next(task_ids)
                labels = [("system", system, block) for block in range(system_prompts[system])]
                labels += [("task", task, block) for block in range(rng.randint(1, 4))]
                active.append(
                    {"id": task, "labels": labels, "base": len(labels), "steps": rng.randint(4, 40)}
                )
        agent = rng.choice(active)
        labels = agent["labels"]
        if len(labels) > agent["base"] + 1 and rng.random() < 0.1:
            # A retry from an earlier step: the context is cut back and grows a new branch.
            labels = labels[: rng.randint(agent["base"], len(labels) - 1)]
        # A tool call and its result; one result in eight is large (a file, a web page).
        size = rng.randint(8, 32) if rng.random() < 0.125 else rng.randint(1, 4)
        step = len(records)
        agent["labels"] = labels = labels + [("step", step, block) for block in range(size)]
        records.append(_record(clock_ms, ids.chain(labels), rng))
        agent["steps"] -= 1
        if agent["steps"] == 0:
            active.remove(agent)
            if rng.random() < 0.3:
                paused.append(agent)
    return records


def _record(clock_ms: float, hash_ids: list[int], rng: random.Random) -> dict[str, Any]:
    return {
        "timestamp": int(clock_ms),
        "input_length": len(hash_ids) * MOONCAKE_BLOCK_TOKENS - rng.randint(0, 511),
        "output_length": rng.randint(16, 512),
        "hash_ids": hash_ids,
    }


def generate_records(workload: Workload, num_requests: int, seed: int) -> list[dict[str, Any]]:
    """Generate a synthetic trace as Mooncake-format records (one JSON object per request).

    Args:
        workload: ``"chat"``, ``"rag"`` or ``"agent"`` (see the module docstring).
        num_requests: How many requests to generate.
        seed: The seed; equal arguments give an equal trace.

    Returns:
        The records, in arrival order.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose one of {', '.join(WORKLOADS)}")
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    rng = random.Random(f"{workload}:{seed}")
    generators = {"chat": _chat, "rag": _rag, "agent": _agent}
    return generators[workload](rng, num_requests)


def generate_trace(workload: Workload, num_requests: int, seed: int) -> list[TraceRequest]:
    """Generate a synthetic trace as requests ready to replay (see :func:`generate_records`)."""
    source = f"synthetic:{workload}:{seed}"
    return [
        mooncake_request(record, f"{source} request {number}")
        for number, record in enumerate(generate_records(workload, num_requests, seed))
    ]
