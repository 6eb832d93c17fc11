"""Row copies between byte matrices in CPU memory, for the ``torch`` backend's CPU path.

A batch copies row ``src[k]`` of one ``[rows, n]`` uint8 matrix to row
``dst[k]`` of another, for every region. Rows are viewed through numpy as
single opaque items (``np.void`` of ``n`` bytes), so each row moves with one
``memcpy`` rather than byte by byte, and numpy releases the GIL while it
copies. The common batch, runs of consecutive blocks and slots few enough
for its size (:meth:`RowCopier.max_runs`; found by
:func:`kvtier.copy.planner.batch_runs` without numpy), goes to
:meth:`RowCopier.copy_runs`, which copies each run as one slice per region.
:meth:`RowCopier.copy` takes id arrays and uses whichever of four plans
:func:`choose_plan` estimates cheapest for them:

- *runs*: the pairs, sorted by destination, form runs in which the
  destination ids count up by one and the source ids up or down by one: each
  run is one slice copy per region, whatever the strides on either side. On
  the caller's thread a large run that counts up is a torch ``copy_``, which
  splits it over torch's intra-op threads, and so is a large run of rows of
  up to 16 KiB that counts down (as when the engine gives a prompt's blocks
  back in the opposite order to its slots), by ``index_select``; other runs
  are numpy slices, reversed for a run that counts down;
- *gather*: every region is a contiguous matrix on both sides (a one-region
  layout) and the destination ids, sorted, form few runs of consecutive rows:
  ``np.take`` of the source rows straight into each destination run;
- *scatter*: the source ids form few runs: each source run is assigned to its
  destination rows by fancy indexing, whatever the strides on either side;
- *staged*: for small rows in many runs (larger rows go run by run, one row a
  run if need be, rather than being copied twice): a cache-sized chunk of
  source rows is gathered into contiguous staging, then scattered by fancy
  indexing. A strided source (a host column) is gathered by numpy's own
  indexing, which makes a temporary of the chunk's rows anyway, so it skips
  the staging buffer.

Run for run, a slice copy is the cheapest of them: on a 2-core machine,
with neither side in the CPU's cache, loading 128 rows of 16 KiB in each of
4 regions (8 MiB, consecutive slots into consecutive blocks) took 0.75 ms by
numpy slices and 1.06 ms by the fancy-indexed scatter; 64 rows of 576 bytes
in each of 61 regions took 0.45 ms and 1.30 ms, and a 4-region store of 8
rows 0.07 ms and 0.34 ms. Torch's ``copy_`` of the same 8 MiB of runs on
two intra-op threads took 0.81 ms against numpy's 0.97 ms (median of 24,
alternating; 1.33 and 1.59 times a contiguous 8 MiB copy), and 1.2 to 1.5
times against numpy's 1.5 to 2.1 times for rows of 2 KiB to 256 KiB. A slice
per row of many runs costs a call each, though, where one fancy-indexed
assignment pays a little per row: loading 32 scattered blocks of 16 KiB from
consecutive slots took 0.61 ms by the scatter and 0.70 ms by slices.
Indexing pays per row and per call on top of the ``memcpy``. ``np.take`` is
only used on contiguous sources (it would first copy a strided source whole)
and with ``mode="clip"`` (the default mode buffers its output).

Large batches are cut into pieces that a small thread pool (the caller's
thread included) takes one at a time, so a thread slowed by another process
holds up at most one piece; there is one join per batch. A batch whose
runs all go to torch is not cut: torch already splits each run, and a torch
copy from a pool thread would start a second team of intra-op threads.

Torch's own ``index_select`` is used for nothing else: on rows of 32 KiB and
more it opens a parallel region per row, which stalls badly when other
processes share the cores.

Torch's intra-op threads only help while they are awake. Where OpenMP is told
to put them to sleep as soon as a parallel region ends (``OMP_WAIT_POLICY=PASSIVE``,
``GOMP_SPINCOUNT=0`` or ``KMP_BLOCKTIME=0``, as operators set when several
processes share the cores), each torch call first wakes them, and numpy on
the caller's thread alone is faster: with ``OMP_WAIT_POLICY=PASSIVE`` on a
2-core machine, neither side in the CPU's cache, loading 128 blocks of 4
regions of 16 KiB (8 MiB, runs counting up) took 1.97 times a contiguous
copy of as many bytes by torch and 1.28 times by numpy, 32 blocks 2.02 and
0.66 times, a store of 128 blocks 1.72 and 1.16 times (medians of 40,
alternating); with OpenMP's default policy 1.26 and 1.32, 1.54 and 1.18,
1.19 and 1.22 times. :func:`openmp_threads_sleep` reads those settings, and
a copier built where they are set copies with numpy only.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.copy.base import Direction
from kvtier.copy.planner import MAX_RUNS, Run

CHUNK_BYTES = 1 << 20
"""Staging chunk per thread: small enough to stay in cache between gather and scatter."""

PARALLEL_MIN_BYTES = 16 << 20
"""Batches moving fewer bytes than this run on the caller's thread alone. On a 2-core
machine an 8 MiB load took 0.8 ms on one thread and 1.6 to 2.7 ms split over two; from
32 MiB up two threads were faster (64 MiB: 9.2 ms on one, 6.0 ms on two)."""

TORCH_RUN_MIN_BYTES = 256 << 10
"""Smallest run (in one region) that the *runs* plan copies with torch rather than numpy: a
torch call costs some 3 us more than numpy's, which its second thread wins back only from
a few hundred KiB (warm rows of 16 KiB on 2 cores: 32 rows 31 us against 32 us, 8 rows
11 us against 10 us)."""

TORCH_REVERSED_MAX_ROW_BYTES = 16 << 10
"""Widest row that the *runs* plan copies with torch (``index_select``, on the caller's
thread) in a large run that counts down. Loading 8 MiB of such a run over 4 regions (cold,
2 cores, median of 60 alternating, against the best contiguous copy): rows of 4, 8 and
16 KiB 1.45, 1.53 and 1.93 times by ``index_select`` against 1.99, 2.09 and 2.58 by numpy's
reversed slices (a run that counts up, by ``copy_``: 1.60, 1.57, 2.03); rows of 32 and
64 KiB 1.82 and 1.81 against numpy's 1.40 and 1.54. Storing such a run of 16 KiB rows
into a host column: 2.07 against 3.10 (``copy_`` of a run that counts up: 2.03)."""

PIECES_PER_THREAD = 4
"""Pieces a large batch is cut into per thread; threads take pieces as they finish, so one
thread delayed by another process does not hold up the whole batch."""

_CALL_S = 2.5e-6
"""Rough fixed cost of one numpy call on a run of rows (in one region), for choosing a plan."""
_ROW_S = 0.15e-6
"""Rough fixed cost per row of fancy indexing, for choosing a plan."""
_STAGING_BYTES_PER_S = 4e9
"""Rough speed of the staged plan's extra pass over a row, cold, for choosing a plan."""
_ARRAYS_S = 300e-6
"""Rough cost of planning a batch from id arrays (:meth:`RowCopier.copy`) when the CPU's
cache is cold, as after a forward pass: in a vLLM engine on 2 cores, eager stores of 32
blocks of 64 KiB (4 regions) in more than 8 runs took 0.81 to 0.87 ms that way and 0.49 to
0.50 ms run by run (medians over 40 batches), of which the copies took 0.37 to 0.42 ms. With
the cache flushed before each copy, loads and stores of 32 and 128 such blocks in 12 to 36
runs took 0.64 to 0.96 times as long run by run as planned from id arrays."""


def openmp_threads_sleep(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``environ`` tells OpenMP's threads, torch's intra-op threads among them, to
    sleep as soon as a parallel region ends: ``OMP_WAIT_POLICY=PASSIVE``,
    ``GOMP_SPINCOUNT=0`` (GNU OpenMP) or ``KMP_BLOCKTIME=0`` (Intel OpenMP)."""
    return (
        environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
        or environ.get("GOMP_SPINCOUNT", "").strip() == "0"
        or environ.get("KMP_BLOCKTIME", "").strip() == "0"
    )


def void_rows(matrix: torch.Tensor) -> np.ndarray:
    """View a ``[rows, n]`` uint8 CPU tensor with contiguous rows as ``rows`` opaque items."""
    rows = matrix.numpy()
    return rows.view(np.dtype((np.void, rows.shape[1])))[:, 0]


def run_starts(ids: np.ndarray) -> np.ndarray:
    """Start positions of the runs of consecutive ids (``ids[k + 1] == ids[k] + 1``)."""
    if ids.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], np.diff(ids) != 1)))


def pair_runs(dst: np.ndarray, src: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, step)`` of each run in which ``dst`` counts up by one and ``src`` by ``step``.

    ``step`` is 1 or -1 (a run of one pair has step 1): rows stored in one
    order and loaded in the other still copy as whole runs.
    """
    count = dst.shape[0]
    if count < 2:
        return [(0, count, 1)] if count else []
    src_step = np.diff(src)
    joined = (np.diff(dst) == 1) & (np.abs(src_step) == 1)
    turned = np.zeros(count - 1, dtype=bool)
    turned[1:] = joined[:-1] & (src_step[1:] != src_step[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joined | turned))).tolist()
    ends = [*starts[1:], count]
    steps = [
        int(src_step[start]) if end - start > 1 else 1
        for start, end in zip(starts, ends, strict=True)
    ]
    return list(zip(starts, ends, steps, strict=True))


@dataclass(frozen=True)
class SortedIds:
    """Ids in ascending order (``ids``), the permutation that sorts them, and their run starts."""

    order: np.ndarray
    ids: np.ndarray
    runs: np.ndarray


def sort_ids(ids: np.ndarray) -> SortedIds:
    """Sort ``ids``, in linear time when they are a permutation of a range or already sorted."""
    count = ids.shape[0]
    low, high = int(ids.min()), int(ids.max())
    if high - low + 1 == count:
        seen = np.zeros(count, dtype=bool)
        seen[ids - low] = True
        if seen.all():
            order = np.empty(count, dtype=np.int64)
            order[ids - low] = np.arange(count)
            return SortedIds(order, np.arange(low, high + 1), np.zeros(1, dtype=np.int64))
    if bool((ids[1:] >= ids[:-1]).all()):
        return SortedIds(np.arange(count), ids, run_starts(ids))
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    return SortedIds(order, ordered, run_starts(ordered))


def choose_plan(
    num_rows: int,
    paired_runs: int,
    dst_runs: int,
    src_runs: int,
    contiguous: bool,
    row_bytes: int,
) -> str:
    """Pick the plan whose estimated cost is least.

    Per region: a plan that works run by run pays a call per run, and
    fancy indexing (*gather*'s ``np.take``, *scatter*'s assignment) a little
    per row on top; the *staged* plan pays an extra pass over every row. So a
    batch of a few runs goes by slices (*runs*); a load of scattered blocks
    from a run of slots by one fancy-indexed assignment (*scatter*, rather
    than a slice per row); a store of scattered blocks into a run of slots by
    a slice per row for rows of 16 KiB and more and through staging for rows
    of 4 KiB and less. The constants reproduce the order of the plans measured
    cold on a 2-core machine, 4 regions, 16 to 128 blocks of 2 KiB to 128 KiB
    rows: a store of 32 scattered blocks of 64 KiB into consecutive slots took
    1.14 ms by slices and 1.57 ms staged, one of 32 blocks of 2 KiB 0.33 ms and
    0.28 ms; a load of 32 blocks of 16 KiB from consecutive slots 0.61 ms by
    one fancy assignment and 0.70 ms by slices.

    Args:
        num_rows: Rows (blocks) in the batch.
        paired_runs: Runs of :func:`pair_runs` once the pairs are sorted by destination.
        dst_runs: Runs of consecutive destination rows, once sorted.
        src_runs: Runs of consecutive source rows, once sorted.
        contiguous: Whether every region is a contiguous matrix on both sides.
        row_bytes: Mean bytes of one row of a region.

    Returns:
        ``"runs"``, ``"gather"``, ``"scatter"`` or ``"staged"`` (see the module
        docstring); of plans that cost the same, the first in that order.
    """
    indexed = num_rows * _ROW_S
    costs = {
        "runs": paired_runs * _CALL_S,
        "gather": dst_runs * _CALL_S + indexed if contiguous else math.inf,
        "scatter": src_runs * _CALL_S + indexed,
        "staged": num_rows * (_ROW_S + row_bytes / _STAGING_BYTES_PER_S),
    }
    return min(costs, key=costs.__getitem__)


class RowCopier:
    """Copies batches of rows between engine regions and host columns in CPU memory.

    One batch at a time: :meth:`copy` is not meant to be called from two threads at once.
    """

    def __init__(
        self,
        regions: Sequence[tuple[torch.Tensor, torch.Tensor]],
        threads: int,
        *,
        torch_runs: bool | None = None,
    ) -> None:
        """Bind the copier to its regions.

        Args:
            regions: Per region, ``(engine_rows, host_rows)``: two ``[rows, n]``
                uint8 CPU tensors with contiguous rows (strided between rows).
            threads: Threads that copy one large batch (1: the caller's only).
            torch_runs: Whether the caller's thread may copy large runs with torch
                (see the module docstring); ``None``: unless
                :func:`openmp_threads_sleep` says torch's threads sleep between calls.

        Raises:
            ValueError: If ``threads`` is not positive or a region pair disagrees on ``n``.
        """
        if threads <= 0:
            raise ValueError(f"threads must be positive, got {threads}")
        for engine, host in regions:
            if engine.shape[1] != host.shape[1]:
                raise ValueError(
                    f"engine rows of {engine.shape[1]} bytes cannot go into host columns of "
                    f"{host.shape[1]} bytes"
                )
        self._tensors = tuple(regions)
        self._regions = tuple((void_rows(engine), void_rows(host)) for engine, host in regions)
        self._contiguous = all(
            engine.flags.c_contiguous and host.flags.c_contiguous for engine, host in self._regions
        )
        self._record_bytes = sum(int(engine.shape[1]) for engine, _ in regions)
        self._narrowest = min(int(engine.shape[1]) for engine, _ in regions)
        self._widest = max(int(engine.shape[1]) for engine, _ in regions)
        self._staging = [
            np.empty(max(CHUNK_BYTES, self._widest), dtype=np.uint8) for _ in range(threads)
        ]
        self._pool = ThreadPoolExecutor(threads - 1, "kvtier-copy") if threads > 1 else None
        self._torch_runs = not openmp_threads_sleep() if torch_runs is None else torch_runs

    def max_runs(self, rows: int) -> int:
        """Most runs for which a batch of ``rows`` rows is cheaper copied run by run
        (:meth:`copy_runs`) than planned from id arrays (:meth:`copy`), whose plans pay at
        least a fancy-indexed row each on top of their planning; never below
        :data:`~kvtier.copy.planner.MAX_RUNS`."""
        regions = len(self._regions)
        arrays = _ARRAYS_S + regions * rows * _ROW_S
        return max(MAX_RUNS, int(arrays / (regions * _CALL_S)))

    def copy(self, direction: Direction, blocks: np.ndarray, slots: np.ndarray) -> None:
        """Copy rows ``blocks[k]`` <-> ``slots[k]`` of every region, in ``direction``.

        The ids must be valid (see :func:`kvtier.copy.planner.batch_arrays`).
        """
        count = blocks.shape[0]
        if count == 0:
            return
        src, dst = (blocks, slots) if direction is Direction.STORE else (slots, blocks)
        by_dst, by_src = sort_ids(dst), sort_ids(src)
        paired = src[by_dst.order]
        pairs = pair_runs(by_dst.ids, paired)
        plan = choose_plan(
            count,
            len(pairs),
            by_dst.runs.shape[0],
            by_src.runs.shape[0],
            self._contiguous,
            self._record_bytes // len(self._regions),
        )
        if plan == "scatter":
            src, dst = src[by_src.order], dst[by_src.order]
        else:
            src, dst = paired, by_dst.ids
        threads = len(self._staging)
        sizes = [(end - start, step) for start, end, step in pairs] if plan == "runs" else None
        if self._caller_alone(count, sizes):
            runs = pairs if plan == "runs" else _runs_for(plan, src, dst)
            self._copy_slice(direction, plan, 0, src, dst, runs, by_torch=self._torch_runs)
            return
        pieces = min(count, PIECES_PER_THREAD * threads)
        bounds = np.linspace(0, count, pieces + 1).astype(np.int64).tolist()
        queue = iter(zip(bounds[:-1], bounds[1:], strict=True))
        lock = threading.Lock()

        def work(staging: int) -> None:
            while True:
                with lock:
                    piece = next(queue, None)
                if piece is None:
                    return
                start, end = piece
                piece_src, piece_dst = src[start:end], dst[start:end]
                runs = _runs_for(plan, piece_src, piece_dst)
                self._copy_slice(direction, plan, staging, piece_src, piece_dst, runs)

        futures = [self._pool.submit(work, staging) for staging in range(1, threads)]
        try:
            work(0)
        finally:
            wait(futures)  # never return while a helper still writes
        for future in futures:
            future.result()

    def copy_runs(self, direction: Direction, runs: Sequence[Run]) -> None:
        """Copy the pairs of ``runs`` (see :data:`kvtier.copy.planner.Run`) in ``direction``.

        The ids must be valid (see :func:`kvtier.copy.planner.batch_runs`).
        Runs need no id arrays to sort or search: each is one slice copy per
        region, unless the batch is large and some run must go through numpy,
        when it is copied as id arrays by :meth:`copy`, which splits it over the
        thread pool.
        """
        spans = [_span(direction, *run) for run in runs]
        sizes = [(size, step) for _, _, size, step in spans]
        if self._caller_alone(sum(size for size, _ in sizes), sizes):
            self._copy_spans(direction, spans, by_torch=self._torch_runs)
            return
        blocks = np.concatenate([np.arange(block, block + size) for block, _, size, _ in runs])
        slots = np.concatenate([slot + step * np.arange(size) for _, slot, size, step in runs])
        self.copy(direction, blocks, slots)

    def close(self) -> None:
        """Stop the thread pool. Idempotent."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def _caller_alone(self, rows: int, runs: list[tuple[int, int]] | None) -> bool:
        """Whether the caller's thread copies a batch of ``rows`` alone: a small one, with
        no pool, or one whose ``(size, step)`` runs all go to torch (which splits each over
        its own threads); ``runs`` is ``None`` for a plan that does not copy by runs."""
        if self._pool is None or rows * self._record_bytes < PARALLEL_MIN_BYTES:
            return True
        return (
            self._torch_runs
            and runs is not None
            and all(_torch_run(size, step, self._narrowest, self._widest) for size, step in runs)
        )

    def _copy_slice(
        self,
        direction: Direction,
        plan: str,
        piece: int,
        src: np.ndarray,
        dst: np.ndarray,
        runs: list[tuple[int, int, int]],
        *,
        by_torch: bool = False,
    ) -> None:
        """Copy one piece of a sorted batch in every region, by the ``runs`` of its plan.

        ``by_torch``: the caller's thread alone copies the batch and may use torch, so the *runs*
        plan copies its large runs that count up with torch (see the module
        docstring).
        """
        if plan == "runs":
            spans = [
                (int(dst[start]), int(src[start]), end - start, step) for start, end, step in runs
            ]
            self._copy_spans(direction, spans, by_torch=by_torch)
            return
        staging = self._staging[piece]
        for engine, host in self._regions:
            source, target = (engine, host) if direction is Direction.STORE else (host, engine)
            if plan == "gather":
                for start, end, _ in runs:
                    into = int(dst[start])
                    out = target[into : into + end - start]
                    np.take(source, src[start:end], out=out, mode="clip")
            elif plan == "scatter":
                for start, end, _ in runs:
                    first = int(src[start])
                    target[dst[start:end]] = source[first : first + end - start]
            else:
                rows = staging.shape[0] // source.dtype.itemsize
                chunk = staging[: rows * source.dtype.itemsize].view(source.dtype)
                _staged(source, target, src, dst, chunk)

    def _copy_spans(
        self, direction: Direction, spans: list[tuple[int, int, int, int]], *, by_torch: bool
    ) -> None:
        """Copy ``(into, first, count, step)`` spans in every region: destination rows
        ``into + k`` from source rows ``first + step * k``, for ``k`` below ``count``."""
        store = direction is Direction.STORE
        for (engine, host), (engine_rows, host_rows) in zip(
            self._regions, self._tensors, strict=True
        ):
            source, target = (engine, host) if store else (host, engine)
            source_rows, target_rows = (
                (engine_rows, host_rows) if store else (host_rows, engine_rows)
            )
            row_bytes = source.dtype.itemsize
            for into, first, count, step in spans:
                if by_torch and _torch_run(count, step, row_bytes, row_bytes):
                    out = target_rows[into : into + count]
                    if step == 1:
                        out.copy_(source_rows[first : first + count])
                    else:
                        rows = torch.arange(first, first - count, -1)
                        torch.index_select(source_rows, 0, rows, out=out)
                elif step == 1:
                    target[into : into + count] = source[first : first + count]
                else:
                    target[into : into + count] = source[first - count + 1 : first + 1][::-1]


def _torch_run(count: int, step: int, narrowest: int, widest: int) -> bool:
    """Whether the caller's thread copies a run of ``count`` rows of ``narrowest`` to
    ``widest`` bytes (over the regions), counting up (``step`` 1) or down, with torch."""
    if count * narrowest < TORCH_RUN_MIN_BYTES:
        return False
    return step == 1 or widest <= TORCH_REVERSED_MAX_ROW_BYTES


def _span(
    direction: Direction, first_block: int, first_slot: int, size: int, step: int
) -> tuple[int, int, int, int]:
    """A run as ``(into, first, count, step)`` with the destination rows counting up."""
    if direction is Direction.LOAD:
        return first_block, first_slot, size, step
    if step == 1:
        return first_slot, first_block, size, 1
    return first_slot - size + 1, first_block + size - 1, size, -1  # lowest slot, last block


def _runs_for(plan: str, src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """``(start, end, step)`` of the runs a plan copies by: pairs for *runs*, destination
    runs for *gather*, source runs for *scatter*, none for *staged*."""
    if plan == "runs":
        return pair_runs(dst, src)
    if plan not in ("gather", "scatter"):
        return []
    starts = run_starts(dst if plan == "gather" else src).tolist()
    return [(start, end, 1) for start, end in zip(starts, [*starts[1:], src.shape[0]], strict=True)]


def _staged(
    source: np.ndarray, target: np.ndarray, src: np.ndarray, dst: np.ndarray, chunk: np.ndarray
) -> None:
    contiguous = source.flags.c_contiguous
    for start in range(0, src.shape[0], chunk.shape[0]):
        size = min(chunk.shape[0], src.shape[0] - start)
        index = src[start : start + size]
        if contiguous:
            np.take(source, index, out=chunk[:size], mode="clip")
            target[dst[start : start + size]] = chunk[:size]
        else:
            # Indexing a strided source gathers into numpy's own temporary already;
            # going through ``chunk`` as well would add a third pass over the rows.
            target[dst[start : start + size]] = source[index]
