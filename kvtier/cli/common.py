"""What every ``kvtier`` command shares: exit statuses, help layout, tables, output checks."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows the default of every option taking a value, unless its text already does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if (
            text is None
            or "(default" in text
            or action.nargs == 0
            or action.default in (None, argparse.SUPPRESS)
        ):
            return text
        return f"{text} (default: %(default)s)"


def subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str) -> Any:
    """Add required subcommands to ``parser``, their help formatted by :class:`HelpFormatter`."""
    return parser.add_subparsers(
        dest=dest, required=True, metavar=metavar, parser_class=_SubcommandParser
    )


class _SubcommandParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"formatter_class": HelpFormatter, **kwargs})


def format_table(rows: list[list[str]]) -> str:
    """Align ``rows`` (the first one a header) in columns two spaces apart."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def check_output_file(path: str) -> None:
    """Check that a command can write a file at ``path``, before its work starts.

    Commands call this for their output options, so a misspelt directory is
    reported at once rather than after a long run.

    Raises:
        ValueError: ``path`` is a directory, its directory does not exist, or
            neither can be written; the message starts with ``path``.
    """
    target = Path(path)
    directory = target.parent
    if target.is_dir():
        raise ValueError(f"{path}: is a directory; give a file name")
    if not directory.exists():
        raise ValueError(f"{path}: directory {directory} does not exist; create it first")
    if not directory.is_dir():
        raise ValueError(f"{path}: {directory} is not a directory")
    writable = target if target.exists() else directory
    if not os.access(writable, os.W_OK):
        raise ValueError(f"{path}: no permission to write {writable}")
