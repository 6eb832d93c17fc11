"""``kvtier plugins``: every registered implementation and who provides it."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtier.cli.common import EXIT_OK, format_table
from kvtier.kinds import KINDS
from kvtier.plugins import default_registry


def add_commands(commands: Any) -> None:
    """Add ``plugins`` to the ``kvtier`` subcommands ``commands``."""
    plugins = commands.add_parser("plugins", help="list the installed plugins")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the registered implementations, kind by kind, as a table or as JSON."""
    registry = default_registry()
    rows = [
        {
            "kind": reg.kind.name,
            "name": reg.name,
            "distribution": reg.distribution,
            "version": reg.version,
            "plugin": reg.plugin,
            "config_model": f"{reg.config_model.__module__}.{reg.config_model.__qualname__}",
        }
        for reg in registry.all()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    table = [["KIND", "NAME", "DISTRIBUTION", "VERSION", "PLUGIN"]]
    for kind in KINDS:
        found = [row for row in rows if row["kind"] == kind.name]
        if not found:
            table.append([kind.title, "(none installed)", "", "", ""])
        for row in found:
            table.append(
                [kind.title, row["name"], row["distribution"], row["version"], row["plugin"]]
            )
    print(format_table(table))
    return EXIT_OK
