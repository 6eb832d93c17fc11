"""Per-request control: what one request asks of kvtier, read from its ``kv_transfer_params``.

An engine hands kvtier a request's parameters as a mapping (vLLM: the
request's ``kv_transfer_params``, from the OpenAI API body or
``SamplingParams.extra_args``); kvtier reads the entry under
:data:`KV_TRANSFER_PARAMS_KEY` only, so other connectors' entries can sit
beside it::

    {"kvtier": {"store": false}}
    {"kvtier": {"store_max_tokens": 1024, "pin_s": 300, "priority": "high"}}

:func:`request_control` validates that entry as a :class:`RequestControl`
and raises :class:`RequestControlError`, one line, for a value it refuses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from kvtier.config.bounds import MAX_DURATION_S
from kvtier.config.errors import Problem
from kvtier.index.base import Priority
from kvtier.models import KVTierModel

KV_TRANSFER_PARAMS_KEY = "kvtier"
"""The entry of a request's ``kv_transfer_params`` that kvtier reads."""

SOURCE = "kv_transfer_params"
"""What an error line names as the source of a refused value."""


class RequestControl(KVTierModel):
    """What a request asks of kvtier: whether to store and load its blocks, pins, priority.

    The defaults ask for nothing different from a request without control.
    """

    model_config = ConfigDict(strict=True)

    store: bool = Field(
        True,
        description=(
            "Store the request's blocks in kvtier's tiers; false keeps them out of every tier "
            "(the host tier and the tiers below it)."
        ),
    )
    load: bool = Field(
        True,
        description="Load tier hits for the request; false computes everything vLLM misses.",
    )
    store_max_tokens: int | None = Field(
        None,
        ge=0,
        description=(
            "Store only the full blocks among the request's first this-many tokens (such as a "
            "shared system prompt), none past them; unset stores every full block."
        ),
    )
    pin_s: float | None = Field(
        None,
        gt=0,
        le=MAX_DURATION_S,
        description=(
            "Keep the request's prompt blocks (within store_max_tokens) in the host tier for "
            "this many seconds from when the engine first schedules it: they are not evicted "
            "until then. The server's pin_max_s cuts it, and pins take at most the server's "
            f"pin_share of the tier. At most {MAX_DURATION_S:g}."
        ),
    )
    priority: Priority = Field(
        "normal",
        description=(
            "Eviction priority of the blocks the request stores or loads in the host tier: "
            "'low' ones are evicted first, 'high' ones only when nothing else can be."
        ),
    )

    def store_limit(self, block_tokens: int) -> int | None:
        """The most leading blocks the request may store (``None``: no limit)."""
        if not self.store:
            return 0
        if self.store_max_tokens is None:
            return None
        return self.store_max_tokens // block_tokens


class RequestControlError(ValueError):
    """A request's kvtier entry of ``kv_transfer_params`` is invalid; the message is one line."""


def request_control(kv_transfer_params: object) -> RequestControl | None:
    """The :class:`RequestControl` in a request's ``kv_transfer_params``, if it has one.

    ``None`` when the parameters are not a mapping or hold no
    :data:`KV_TRANSFER_PARAMS_KEY` entry.

    Raises:
        RequestControlError: The entry is invalid; one line naming each problem.
    """
    if not isinstance(kv_transfer_params, Mapping):
        return None
    given = kv_transfer_params.get(KV_TRANSFER_PARAMS_KEY)
    if given is None:
        return None
    if not isinstance(given, Mapping):
        raise RequestControlError(
            str(
                Problem(
                    SOURCE,
                    KV_TRANSFER_PARAMS_KEY,
                    f"must be an object with some of the keys {_keys()}",
                    given,
                )
            )
        )
    try:
        return RequestControl.model_validate(dict(given))
    except ValidationError as exc:
        problems = [_problem(error) for error in exc.errors(include_url=False)]
        raise RequestControlError("; ".join(str(problem) for problem in problems)) from None


def _keys() -> str:
    return ", ".join(sorted(RequestControl.model_fields))


def _problem(error: Mapping[str, Any]) -> Problem:
    path = ".".join([KV_TRANSFER_PARAMS_KEY, *(str(part) for part in error["loc"])])
    if error["type"] == "extra_forbidden":
        return Problem(SOURCE, path, f"unknown key; valid keys here: {_keys()}", error["input"])
    return Problem(SOURCE, path, error["msg"], error["input"])
