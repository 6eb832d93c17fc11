"""RunningScan finds the same running requests as looking at every one, in any step sequence."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm033

from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)

from kvtier.integrations.vllm.running import RunningScan  # noqa: E402


def every_request_with_news(output: SchedulerOutput, tracked: set[str], size: int) -> list[int]:
    """The positions, by looking at every running request (what the scheduler half did)."""
    cached = output.scheduled_cached_reqs
    if output.scheduled_spec_decode_tokens:
        return list(range(len(cached.req_ids)))
    return [
        i
        for i, (req_id, before, new_blocks) in enumerate(
            zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True)
        )
        if new_blocks
        or (before + output.num_scheduled_tokens.get(req_id, 0)) // size != before // size
        or req_id in cached.resumed_req_ids
        or req_id not in tracked
    ]


@dataclass
class Running:
    req_id: str
    tokens: int
    """Prompt and output tokens so far; ``computed`` catches up with it."""
    computed: int = 0
    blocks: int = 0
    resumed: bool = False


@dataclass
class Engine:
    """A small stand-in for vLLM's scheduler: what its outputs say of running requests."""

    rng: random.Random
    size: int
    running: list[Running] = field(default_factory=list)
    preempted: list[Running] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    arrivals: int = 0
    next_block: int = 1

    def blocks(self, count: int) -> tuple[list[int], ...]:
        start, self.next_block = self.next_block, self.next_block + count
        return (list(range(start, start + count)),)

    def step(self, busy: float) -> tuple[SchedulerOutput, dict[str, int]]:
        """One step's output, and the drafts each request will have rejected after it."""
        rng, size = self.rng, self.size
        new: list[NewRequestData] = []
        preempted: set[str] = set()
        scheduled: dict[str, int] = {}
        spec: dict[str, list[int]] = {}
        if rng.random() < busy:
            event = rng.choice(["arrive", "finish", "preempt", "resume", "chunk", "skip", "spec"])
        else:
            event = "decode"
        if event == "arrive" or not self.running:
            for _ in range(rng.randint(1, 3)):
                request = Running(f"r{self.arrivals}", rng.randint(1, 5 * size))
                self.arrivals += 1
                # vLLM's own prefix hit, in whole blocks, then a first chunk of the prompt
                request.computed = rng.randrange(0, request.tokens, size)
                tokens = rng.randint(1, request.tokens - request.computed)
                request.blocks = -(-(request.computed + tokens) // size)
                new.append(
                    NewRequestData(
                        req_id=request.req_id,
                        prompt_token_ids=None,
                        mm_features=[],
                        sampling_params=None,
                        pooling_params=None,
                        block_ids=self.blocks(request.blocks),
                        num_computed_tokens=request.computed,
                        lora_request=None,
                    )
                )
                scheduled[request.req_id] = tokens
                self.running.append(request)
        elif event == "finish":
            for request in rng.sample(self.running, rng.randint(1, len(self.running))):
                self.running.remove(request)
                self.finished.add(request.req_id)
        elif event == "preempt":
            request = self.running.pop(rng.randrange(len(self.running)))
            request.computed, request.blocks = 0, 0
            self.preempted.append(request)
            preempted.add(request.req_id)
        elif event == "resume" and self.preempted:
            request = self.preempted.pop(0)
            request.resumed = True
            self.running.append(request)
        cached: list[Running] = []
        for request in self.running:
            if request.req_id in scheduled:
                continue
            if event == "skip" and rng.random() < 0.3:
                continue  # the token budget ran out before it
            left = request.tokens - request.computed
            if left > 1 and (event == "chunk" or request.resumed):
                tokens = rng.randint(1, left)  # a chunk of a prefill
            else:
                tokens = 1
                request.tokens += 1  # the token it computes is sampled at the end
            if event == "spec" and rng.random() < 0.5:
                drafts = rng.randint(1, 3)
                spec[request.req_id] = [0] * drafts
                tokens += drafts
            scheduled[request.req_id] = tokens
            cached.append(request)
        new_block_ids: list[tuple[list[int], ...] | None] = []
        for request in cached:
            # vLLM allocates the blocks the scheduled tokens need, now and then one ahead
            needed = -(-(request.computed + scheduled[request.req_id]) // size) - request.blocks
            needed += rng.random() < 0.02
            if request.resumed:
                needed = max(needed, 0)
            new_block_ids.append(self.blocks(needed) if needed > 0 else None)
            request.blocks += max(needed, 0)
        resumed = {request.req_id for request in cached if request.resumed}
        output = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=[request.req_id for request in cached],
                resumed_req_ids=resumed,
                new_token_ids=[],
                all_token_ids={},
                new_block_ids=new_block_ids,
                num_computed_tokens=[request.computed for request in cached],
                num_output_tokens=[0 for _ in cached],
            ),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            scheduled_spec_decode_tokens=spec,
            scheduled_encoder_inputs={},
            finished_req_ids=self.finished,
            free_encoder_mm_hashes=[],
            preempted_req_ids=preempted,
        )
        self.finished = set()
        for request in self.running:
            request.resumed = False
        rejected = {req_id: rng.randint(0, len(drafts)) for req_id, drafts in spec.items()}
        return output, rejected

    def update(self, output: SchedulerOutput, rejected: dict[str, int]) -> None:
        """After the step: counts move on, less rejected drafts and the odd failed load."""
        for request in self.running:
            tokens = output.num_scheduled_tokens.get(request.req_id, 0)
            request.computed += tokens - rejected.get(request.req_id, 0)
            if tokens and self.rng.random() < 0.002:
                # a failed load: vLLM recomputes from the first failed block
                request.computed = self.rng.randrange(0, request.computed + 1, self.size)
            request.tokens = max(request.tokens, request.computed + 1)


@pytest.mark.parametrize("size", [1, 4, 16])
@pytest.mark.parametrize("busy", [0.02, 0.2, 0.8])
@pytest.mark.parametrize("seed", range(3))
def test_running_scan_finds_what_a_visit_of_every_request_finds(
    size: int, busy: float, seed: int
) -> None:
    engine = Engine(random.Random(seed), size)
    scan = RunningScan(size)
    tracked: set[str] = set()
    uniform = 0
    for step in range(600):
        output, rejected = engine.step(busy)
        tracked.update(new.req_id for new in output.scheduled_new_reqs)
        tracked.difference_update(output.finished_req_ids)
        expected = every_request_with_news(output, tracked, size)
        found = list(scan.positions(output, tracked))
        assert found == expected, f"step {step}"
        uniform += scan._phases is not None
        tracked.update(output.scheduled_cached_reqs.req_ids[i] for i in found)
        engine.update(output, rejected)
    if busy < 0.5:
        assert uniform > 300  # most steps took the buckets
