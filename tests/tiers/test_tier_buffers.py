"""ReadBuffers: reused once dropped, never while held, per thread and within its bound."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

from kvtier.tiers.buffers import ReadBuffers


def base(view: memoryview) -> object:
    """The buffer a view was cut from."""
    return view.obj


def watch(view: memoryview) -> weakref.ref[object]:
    """A reference to the buffer of ``view`` that does not hold it."""
    return weakref.ref(base(view))


def test_a_dropped_buffer_is_handed_out_again() -> None:
    buffers = ReadBuffers(1024, keep_bytes=2048)
    first = buffers.take(100)
    buffer = watch(first)
    del first
    again = buffers.take(1024)
    assert base(again) is buffer() and len(again) == 1024


def test_a_held_buffer_is_never_written_over() -> None:
    buffers = ReadBuffers(64, keep_bytes=64 * 4)
    held = buffers.take(64)
    held[:] = b"h" * 64
    array = np.frombuffer(held, np.uint8)[8:]  # a view of a view holds the buffer too
    del held
    for _ in range(10):
        other = buffers.take(64)
        other[:] = b"x" * 64
        del other
    assert bytes(array) == b"h" * 56


def test_a_buffer_held_for_good_does_not_stop_the_others_being_reused() -> None:
    buffers = ReadBuffers(64, keep_bytes=64 * 2)
    stuck = buffers.take(64)
    kept = {id(base(buffers.take(64)))}  # the second buffer kept, dropped at once
    reused = [id(base(buffers.take(64))) for _ in range(6)]
    assert kept & set(reused)
    assert id(base(stuck)) not in reused


def test_each_thread_keeps_at_most_its_bound_and_its_own_buffers() -> None:
    buffers = ReadBuffers(64, keep_bytes=64 * 2)
    views = [buffers.take(64) for _ in range(3)]
    watched = [watch(view) for view in views]
    del views
    assert watched[2]() is None  # not kept: the bound is two
    again = [buffers.take(64), buffers.take(64)]
    assert {id(base(view)) for view in again} == {id(ref()) for ref in watched[:2]}
    del again
    elsewhere: list[object] = []
    thread = threading.Thread(target=lambda: elsewhere.append(base(buffers.take(64))))
    thread.start()
    thread.join()
    assert all(elsewhere[0] is not ref() for ref in watched[:2])


def test_kept_bytes_count_the_buffers_kept_in_every_thread_and_no_other() -> None:
    buffers = ReadBuffers(64, keep_bytes=64 * 2, align=16)
    assert buffers.kept_bytes == 0
    views = [buffers.take(64) for _ in range(3)]  # the third is not kept
    views.append(buffers.take(100))  # above capacity: never kept
    kept = sum(base(view).nbytes for view in views[:2])
    assert buffers.kept_bytes == kept >= 2 * 64
    del views
    buffers.take(64)  # reused: nothing new
    assert buffers.kept_bytes == kept
    thread = threading.Thread(target=buffers.take, args=(64,))
    thread.start()
    thread.join()
    assert buffers.kept_bytes == kept + kept // 2


def test_a_size_above_capacity_gets_a_buffer_of_its_own() -> None:
    buffers = ReadBuffers(64)
    big = buffers.take(100)
    assert len(big) == 100
    del big
    assert len(buffers.take(64)) == 64


@pytest.mark.parametrize("size", [1, 4095, 4096, 10_000])
def test_views_start_on_the_alignment_asked_for(size: int) -> None:
    buffers = ReadBuffers(8192, align=4096)
    views = [buffers.take(size) for _ in range(3)] + [buffers.take(20_000)]
    assert all(np.frombuffer(view, np.uint8).ctypes.data % 4096 == 0 for view in views)


def test_a_capacity_or_alignment_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ReadBuffers(0)
    with pytest.raises(ValueError, match="at least 1"):
        ReadBuffers(8, align=0)
