"""``kvtier config``: validate a configuration, show it with its sources, print its schema."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvtier.cli.common import EXIT_OK, format_table, subcommands
from kvtier.config import (
    CONFIG_FILE_ENV,
    MAX_CONFIG_DEPTH,
    ConfigError,
    Problem,
    config_json_schema,
    load_config,
)
from kvtier.config.units import format_bytes, parse_bytes
from kvtier.config_reference import render_config_reference
from kvtier.plugins import default_registry


def add_commands(commands: Any) -> None:
    """Add ``config`` and its actions to the ``kvtier`` subcommands ``commands``."""
    config = commands.add_parser("config", help="validate, show or describe the configuration")
    config_commands = subcommands(config, "config_command", "ACTION")
    validate = config_commands.add_parser(
        "validate",
        help="check a config file or JSON string, with KVTIER_* variables applied",
        description=(
            "Check a config (a file, a JSON string as given to vLLM, or both), with KVTIER_* "
            "variables applied, and that its host tier fits in the memory this machine has "
            "available."
        ),
    )
    validate.add_argument(
        "file",
        nargs="?",
        help="YAML (.yaml, .yml), TOML (.toml) or JSON (.json) config file "
        "(default: $KVTIER_CONFIG, if set)",
    )
    validate.add_argument(
        "--json",
        dest="json_config",
        metavar="STRING",
        help="config as a JSON object, exactly as given to vLLM in kv_connector_extra_config; "
        "it overrides the file and KVTIER_* variables, as in vLLM (default: none)",
    )
    validate.add_argument(
        "--record-bytes",
        type=_positive_bytes,
        metavar="SIZE",
        help="also check that the host tier holds blocks of SIZE bytes, one block across all "
        "layers (default: not checked)",
    )
    validate.add_argument(
        "--world-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help=(
            "ranks the host tier is split over, all on this machine: the memory check counts "
            "every rank's share"
        ),
    )
    validate.add_argument(
        "--no-memory-check",
        dest="memory_check",
        action="store_false",
        help="skip the memory check, e.g. to check a server's config on another machine",
    )
    validate.set_defaults(handler=_validate)
    show = config_commands.add_parser(
        "show", help="print the effective config and where each value came from"
    )
    show.add_argument("file", nargs="?", help="config file (default: $KVTIER_CONFIG, if set)")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(handler=_show)
    schema = config_commands.add_parser(
        "schema", help="print the JSON Schema of the config, plugin models included"
    )
    schema.set_defaults(handler=_schema)
    reference = config_commands.add_parser(
        "reference", help="print the config reference as Markdown"
    )
    reference.add_argument(
        "--all", action="store_true", help="include implementations from every installed plugin"
    )
    reference.set_defaults(handler=_reference)


def _validate(args: argparse.Namespace) -> int:
    explicit = None if args.json_config is None else _json_config(args.json_config)
    config = load_config(explicit, config_file=args.file)
    if args.memory_check:
        config.check_host_memory(args.world_size, ranks=args.world_size)
    checked = _what_validate_checked(args)
    if args.record_bytes is None:
        print(f"{checked}: valid kvtier configuration")
        return EXIT_OK
    slots = config.host_slots(args.record_bytes, args.world_size)
    print(
        f"{checked}: valid kvtier configuration; {slots} blocks of {args.record_bytes} bytes "
        f"per rank over {args.world_size} rank(s)"
    )
    return EXIT_OK


def _json_config(text: str) -> dict[str, Any]:
    """The ``--json`` value: a JSON object of config keys, as vLLM's kv_connector_extra_config."""
    source = "argument --json"
    try:
        value = json.loads(text)
    except RecursionError:
        message = f"nested more than {MAX_CONFIG_DEPTH} levels deep"
        raise ConfigError([Problem(source, "(root)", message, text)]) from None
    except ValueError as exc:
        raise ConfigError([Problem(source, "(root)", f"not JSON: {exc}", text)]) from None
    if not isinstance(value, dict):
        message = "expected a JSON object of config keys, like kv_connector_extra_config"
        raise ConfigError([Problem(source, "(root)", message, value)])
    return value


def _what_validate_checked(args: argparse.Namespace) -> str:
    """Name what ``config validate`` checked, for its verdict line."""
    file = args.file if args.file is not None else os.environ.get(CONFIG_FILE_ENV) or None
    parts = [part for part in (file, args.json_config is not None and "--json") if part]
    return " with ".join(parts) if parts else "KVTIER_* variables and defaults"


def _positive_bytes(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return int(value)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def _show(args: argparse.Namespace) -> int:
    config = load_config(config_file=args.file)
    sources = config.sources()
    flat = _flatten(config.model_dump(mode="json"))
    if args.json:
        print(json.dumps({"config": config.model_dump(mode="json"), "sources": sources}, indent=2))
        return EXIT_OK
    table = [["KEY", "VALUE", "SOURCE"]]
    table.extend([path, _shown(path, value), sources[path]] for path, value in flat.items())
    print(format_table(table))
    return EXIT_OK


def _shown(path: str, value: Any) -> str:
    """A value as ``config show`` prints it: sizes (``*_bytes``) in units, the rest as JSON."""
    if path.endswith("_bytes") and isinstance(value, int) and not isinstance(value, bool):
        return format_bytes(value)
    return json.dumps(value)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_json_schema(), indent=2))
    return EXIT_OK


def _reference(args: argparse.Namespace) -> int:
    distribution = None if args.all else "kvtier"
    print(render_config_reference(default_registry(), distribution=distribution), end="")
    return EXIT_OK
