"""The quiet mark: the scheduler side's modules say whether they are idle, and calls wake them.

Most steps of a serving engine change nothing in the tier. Each module of the
manager says whether it is ``idle`` (nothing in flight, pending, evicted,
observed or to announce), from a few of its own fields. The manager keeps their
joint answer in one attribute, ``quiet``, so that a step that finds it set costs
one attribute read instead of a visit to every module (which a step of the
engine's own work has pushed out of the CPU's caches); a call that may give a
module work clears it (:func:`wakes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Idling(Protocol):
    """A module that says whether it has anything left to do or to announce."""

    @property
    def idle(self) -> bool: ...


class Quiet(Protocol):
    quiet: bool


_Q = TypeVar("_Q", bound=Quiet)


def wakes(call: Callable[Concatenate[_Q, _P], _R]) -> Callable[Concatenate[_Q, _P], _R]:
    """Mark a method that may give a module work: it clears its object's ``quiet`` first."""

    @functools.wraps(call)
    def woken(holder: _Q, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        holder.quiet = False
        return call(holder, *args, **kwargs)

    return woken
