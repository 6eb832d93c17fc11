"""Owns the cost guard: a tier read predicted slower than recomputing its tokens is skipped.

A load only pays when copying a block back is cheaper than computing it again,
and that depends on the tier and on the model: a disk or network read can take
longer than a small model's prefill, and for a tiny model even a host-tier hit
can. The guard learns, as the engine runs, what each costs, and decides per
load, whatever the tier:

- **host loads**: each worker times each load batch from its submission until
  it sees the copy done, which is what the request waits for
  (:attr:`WorkerReport.load_times <kvtier.offload.WorkerReport.load_times>`);
- **lower-tier reads**: each tier read of a promotion, from asking the tier to
  its answer (:attr:`WorkerReport.read_times
  <kvtier.offload.WorkerReport.read_times>`, per tier), and each tier's answer
  to a promotion's probe as a read of no record, so a tier that answers at its
  deadline is measured as slow as it is, misses included;
- **prefill**: the engine integration reports each step's scheduled tokens
  and duration (:meth:`OffloadManager.step_timed
  <kvtier.offload.OffloadManager.step_timed>`).

Each is a :class:`CostModel`, ``seconds = fixed + per_unit * units``, and the
guard compares a load's whole predicted time (a promotion: the tier's read and
then the host load) with the *marginal* prefill cost of the tokens it would
save (``per_unit * tokens``): the request's step overhead is paid either way.
A load is skipped when it is predicted to take more than ``margin`` times the
recompute; its tokens are then computed by the engine, as on a miss.

Rules that keep it safe and cheap:

- **Warm-up**: a cost with fewer than :data:`MIN_SAMPLES` measurements makes
  no prediction, and no prediction means no skip: a new engine loads every hit
  until it knows better.
- **Probes**: after :data:`PROBE_EVERY` skips in a row of one source (the host
  tier or a lower tier), its next read goes ahead, so a tier that became fast
  again is measured again.
- **Prefetches** (reads started at a request's arrival) behind requests still
  waiting for their turn are not judged when they start: they run while the
  request waits in the engine's queue, off its path. A lookup that finds a
  prefetch's reads still running asks :meth:`CostGuard.worth_waiting` once,
  and stops waiting for reads every tier of which is predicted slower than
  recomputing.
- A decision is a few float operations per looked-up request; nothing is
  computed per step but one weighted sum per timed step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvtier.offload.messages import WorkerReport
from kvtier.offload.stats import Counters

MIN_SAMPLES = 8
"""Measurements a cost needs before it predicts anything (the warm-up)."""

HALF_LIFE_SAMPLES = 32.0
"""A measurement weighs half as much as the newest after this many newer ones."""

PROBE_EVERY = 16
"""After this many skips in a row of one source, its next read goes ahead and is measured."""

HOST = ""
"""The source key of host-tier loads in :attr:`CostGuard.costs` (tiers have names)."""

_MIN_SPREAD = 0.1
"""Below this coefficient of variation of ``units``, a line fit is noise: cost is taken as
proportional to ``units`` (a prefill per-token cost then includes the step overhead, which
errs toward loading)."""


class CostModel:
    """``seconds = fixed_s + per_unit_s * units``, fitted by exponentially weighted least squares.

    Every measurement updates five running sums in constant time; a fit reads them.
    """

    __slots__ = ("_decay", "_grows", "_w", "_x", "_y", "_xx", "_xy", "samples")

    def __init__(self, half_life: float = HALF_LIFE_SAMPLES, *, grows: bool = False) -> None:
        """``grows``: the cost always grows with ``units`` (computing tokens), so a fit whose
        slope is not positive is noise, not a fixed cost (see :meth:`fit`)."""
        self._decay = 0.5 ** (1.0 / half_life)
        self._grows = grows
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.samples = 0
        """Measurements so far."""

    def add(self, units: float, seconds: float) -> None:
        """Count one measurement: ``units`` (blocks, records or tokens) took ``seconds``."""
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + units
        self._y = self._y * d + seconds
        self._xx = self._xx * d + units * units
        self._xy = self._xy * d + units * seconds
        self.samples += 1

    def fit(self) -> tuple[float, float] | None:
        """``(fixed_s, per_unit_s)``, both at least 0; ``None`` during the warm-up.

        A line when the measurements' sizes spread (a fixed cost, their mean, when
        cost does not grow with size: reads of a few records among probes that read
        none); otherwise, and for a cost that ``grows`` when the line does not (step
        times of a loaded machine: computing is never free), cost proportional to size
        (or, when every measurement moved nothing, its mean as a fixed cost).
        """
        if self.samples < MIN_SAMPLES:
            return None
        w = self._w
        mean_x, mean_y = self._x / w, self._y / w
        variance = self._xx / w - mean_x * mean_x
        if variance > (_MIN_SPREAD * mean_x) ** 2:
            per_unit = (self._xy / w - mean_x * mean_y) / variance
            if per_unit > 0 or not self._grows:
                per_unit = max(per_unit, 0.0)
                return max(mean_y - per_unit * mean_x, 0.0), per_unit
        if mean_x > 0:
            return 0.0, mean_y / mean_x
        return mean_y, 0.0

    def predict(self, units: float) -> float | None:
        """Predicted seconds for ``units``; ``None`` during the warm-up."""
        fit = self.fit()
        return None if fit is None else fit[0] + fit[1] * units


class CostGuard:
    """The measured costs, and the per-load decisions made on them."""

    def __init__(
        self,
        counters: Counters,
        *,
        block_tokens: int,
        tier_names: Sequence[str] = (),
        enabled: bool = False,
        margin: float = 1.0,
    ) -> None:
        """Decide loads of ``block_tokens``-token blocks; ``tier_names``: the lower tiers in
        lookup order. Disabled, it measures nothing and skips nothing.

        Raises:
            ValueError: ``margin`` is not positive.
        """
        if margin <= 0:
            raise ValueError(f"the cost guard's margin must be positive, got {margin}")
        self.counters = counters
        self.block_tokens = block_tokens
        self.tier_names = tuple(tier_names)
        self.enabled = enabled
        self.margin = margin
        self.prefill = CostModel(grows=True)
        """Seconds of a step by the tokens it computed."""
        self.costs: dict[str, CostModel] = {HOST: CostModel()}
        """Per source (:data:`HOST` or a tier's name): seconds of a read by its blocks."""
        self._skips_in_a_row: dict[str, int] = {}
        self._host_decisions: dict[str, tuple[int, bool]] = {}

    def step_timed(self, computed_tokens: int, seconds: float) -> None:
        """The engine computed ``computed_tokens`` tokens in a step of ``seconds``."""
        if self.enabled and computed_tokens > 0:
            self.prefill.add(computed_tokens, seconds)

    def measured(self, reports: Iterable[WorkerReport]) -> None:
        """Add the reports' load and read timings."""
        if not self.enabled:
            return
        costs = self.costs
        host = costs[HOST]
        for report in reports:
            for blocks, seconds in report.load_times:
                host.add(blocks, seconds)
            for name, times in report.read_times.items():
                tier = costs.get(name)
                if tier is None:
                    tier = costs[name] = CostModel()
                for records, seconds in times:
                    tier.add(records, seconds)

    def load_host_hit(self, request_id: str, blocks: int) -> bool:
        """Whether to load a host-tier hit of ``blocks`` blocks for ``request_id``.

        A request asked again for the same hit gets the same answer (until
        :meth:`forget`); its skipped tokens are counted once.
        """
        if not self.enabled or blocks == 0:
            return True
        decided = self._host_decisions.get(request_id)
        if decided is not None and decided[0] == blocks:
            return decided[1]
        load = self._decide(HOST, blocks, 0.0)
        if not load and (decided is None or decided[1]):
            self.counters.add("guard_skipped_tokens", blocks * self.block_tokens)
        self._host_decisions[request_id] = (blocks, load)
        return load

    def skipped_tiers(self, blocks: int) -> frozenset[str]:
        """The lower tiers not to read ``blocks`` missing blocks from (a promotion)."""
        if not self.enabled or not self.tier_names:
            return frozenset()
        host = self.costs[HOST].predict(blocks)
        skipped = frozenset(
            name for name in self.tier_names if not self._decide(name, blocks, host or 0.0)
        )
        if skipped:
            self.counters.add_tier_counts(
                {name: {"guard_skipped_records": blocks} for name in skipped}
            )
        return skipped

    def worth_waiting(self, blocks: int) -> bool:
        """Whether a lookup should wait for reads of ``blocks`` blocks already running (a
        prefetch's): ``False`` when every lower tier's read is predicted slower than
        recomputing them, counted as those tiers' skipped records. Probes do not apply: the
        reads run whatever the answer, and are measured."""
        if not self.enabled or not self.tier_names:
            return True
        host = self.costs[HOST].predict(blocks) or 0.0
        for name in self.tier_names:
            predicted = self._predicted(name, blocks, host)
            if predicted is None or predicted[0] <= self.margin * predicted[1]:
                return True
        self.counters.add_tier_counts(
            {name: {"guard_skipped_records": blocks} for name in self.tier_names}
        )
        return False

    def forget(self, request_id: str) -> None:
        """The request was allocated, preempted or finished: its next lookup decides anew."""
        self._host_decisions.pop(request_id, None)

    def _predicted(self, source: str, blocks: int, then_s: float) -> tuple[float, float] | None:
        """Predicted seconds to read ``blocks`` from ``source`` (then ``then_s`` more) and to
        recompute them; ``None`` during either cost's warm-up."""
        cost = self.costs.get(source)
        read_s = cost.predict(blocks) if cost is not None else None
        prefill = self.prefill.fit()
        if read_s is None or prefill is None:
            return None
        return read_s + then_s, prefill[1] * blocks * self.block_tokens

    def _decide(self, source: str, blocks: int, then_s: float) -> bool:
        """Whether reading ``blocks`` from ``source`` (then ``then_s`` more seconds) is
        predicted no slower than ``margin`` times recomputing them, or is a probe."""
        predicted = self._predicted(source, blocks, then_s)
        if predicted is None:
            return True  # warm-up: no measurements, no skipping
        load_s, recompute_s = predicted
        counters = self.counters
        counters.observe(counters.observations.guard_load_seconds, load_s)
        counters.observe(counters.observations.guard_recompute_seconds, recompute_s)
        if load_s <= self.margin * recompute_s:
            self._skips_in_a_row[source] = 0
            return True
        skips = self._skips_in_a_row.get(source, 0) + 1
        if skips > PROBE_EVERY:
            self._skips_in_a_row[source] = 0
            return True  # a probe: measure the source again
        self._skips_in_a_row[source] = skips
        return False
