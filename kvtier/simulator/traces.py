"""Request traces for replay: the Mooncake format and kvtier's token-id format.

Both are JSON Lines, one request per line, in arrival order:

- Mooncake (``hash_ids``): ``{"timestamp": ms, "input_length": tokens,
  "output_length": tokens, "hash_ids": [int, ...]}``. Each id names one prompt
  block and already encodes its prefix (equal ids mean an equal prefix up to that
  block), so an id is used as the block key directly.
- kvtier (``token_ids``): ``{"timestamp": ms, "token_ids": [int, ...]}``. The
  prompt is cut into full blocks of ``block_tokens`` tokens and each block is
  named by :func:`kvtier.keys.hash_token_blocks` (chained: equal keys mean equal
  prefixes); a trailing partial block is not cached. Token ids are 64-bit
  signed integers.

A trace is a regular file of UTF-8 text; anything else (a directory, a named
pipe, a device) is refused before a byte is read.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from kvtier.index.base import BlockKey
from kvtier.keys import hash_token_blocks

TraceFormat = Literal["auto", "mooncake", "kvtier"]

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""

TOKEN_ID_MIN = -(2**63)
TOKEN_ID_MAX = 2**63 - 1
"""Token ids are hashed as signed 64-bit integers (see :func:`kvtier.keys.hash_token_blocks`)."""


class TraceError(ValueError):
    """A trace file is malformed; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrived and its prompt's block keys, root first."""

    timestamp_ms: float
    keys: tuple[BlockKey, ...]


def mooncake_key(hash_id: int) -> BlockKey:
    """The block key of a Mooncake ``hash_ids`` entry (8 bytes, big-endian)."""
    return hash_id.to_bytes(8, "big")


def mooncake_request(record: dict[str, Any], where: str) -> TraceRequest:
    """Parse one Mooncake-format record; ``where`` names it in errors."""
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and 0 <= h < 2**64 for h in hash_ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of integers in [0, 2**64)")
    return TraceRequest(_timestamp(record, where), tuple(mooncake_key(h) for h in hash_ids))


def _kvtier_request(record: dict[str, Any], where: str, block_tokens: int) -> TraceRequest:
    token_ids = record.get("token_ids")
    if not isinstance(token_ids, list):
        raise TraceError(f"{where}: 'token_ids' must be a list of integers")
    for position, token in enumerate(token_ids):
        if type(token) is not int or not TOKEN_ID_MIN <= token <= TOKEN_ID_MAX:
            shown = json.dumps(token) if type(token) is not int else str(token)
            if len(shown) > 40:
                shown = f"{shown[:37]}..."
            raise TraceError(
                f"{where}: token_ids[{position}] is {shown}; token ids must be integers "
                "from -2**63 to 2**63 - 1"
            )
    keys = hash_token_blocks(token_ids, block_tokens)
    return TraceRequest(_timestamp(record, where), tuple(keys))


def _timestamp(record: dict[str, Any], where: str) -> float:
    timestamp = record.get("timestamp", 0)
    if not isinstance(timestamp, (int, float)):
        raise TraceError(f"{where}: 'timestamp' must be a number of milliseconds")
    return float(timestamp)


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a named pipe"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _require_regular_file(path: Path, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    raise TraceError(
        f"{path}: is {kind}, not a trace file; give a JSON Lines file "
        "(save a stream to a file first)"
    )


def check_trace_file(path: str | Path) -> None:
    """Check, without opening it, that ``path`` is a regular file a trace can be read from.

    Raises:
        TraceError: ``path`` is a directory, a named pipe, a device or a socket.
        OSError: ``path`` does not exist (:class:`FileNotFoundError`) or cannot be examined.
    """
    path = Path(path)
    _require_regular_file(path, path.stat().st_mode)


def _open_trace(path: Path) -> BinaryIO:
    # Opened without blocking and checked before any read: opening a named pipe
    # for reading would otherwise wait for a writer forever.
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        _require_regular_file(path, os.fstat(descriptor).st_mode)
    except BaseException:
        os.close(descriptor)
        raise
    return os.fdopen(descriptor, "rb")


def _records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    with _open_trace(path) as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(
                    f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                    f"{exc.start + 1}); a trace is UTF-8 JSON Lines"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not valid JSON ({exc.msg})") from exc
            except RecursionError:
                raise TraceError(
                    f"{where}: JSON nested too deeply to read; a request is one object "
                    "of numbers and lists of numbers"
                ) from None
            except ValueError as exc:
                # The only other refusal of json.loads: an integer of thousands of digits.
                raise TraceError(
                    f"{where}: a number has too many digits to read; ids, token ids and "
                    "timestamps fit in 64 bits"
                ) from exc
            if not isinstance(record, dict):
                raise TraceError(f"{where}: each line must be a JSON object")
            yield where, record


def load_trace(
    path: str | Path, trace_format: TraceFormat = "auto", block_tokens: int = 16
) -> list[TraceRequest]:
    """Read a trace file into requests, in file order.

    Args:
        path: A JSON Lines trace in the Mooncake or the kvtier format.
        trace_format: ``"mooncake"``, ``"kvtier"``, or ``"auto"`` to decide per
            line from whether it has ``hash_ids`` or ``token_ids``.
        block_tokens: Tokens per block when hashing ``token_ids`` requests.

    Returns:
        The requests with their block keys.

    Raises:
        TraceError: ``path`` is not a regular file, or has a line that is not a
            request of the format (the message names the file and the line).
        OSError: ``path`` does not exist (:class:`FileNotFoundError`) or cannot be read.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    path = Path(path)
    requests = []
    for where, record in _records(path):
        kind = trace_format
        if kind == "auto":
            if "hash_ids" in record:
                kind = "mooncake"
            elif "token_ids" in record:
                kind = "kvtier"
            else:
                raise TraceError(
                    f"{where}: a request needs 'hash_ids' (Mooncake format) or "
                    "'token_ids' (kvtier format)"
                )
        if kind == "mooncake":
            requests.append(mooncake_request(record, where))
        else:
            requests.append(_kvtier_request(record, where, block_tokens))
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return requests
