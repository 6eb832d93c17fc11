"""The ``kvtier`` command line: installed plugins, config validation, schema, benchmarks.

Subcommands::

    kvtier plugins [--json]          every registered implementation and who provides it
    kvtier config validate [FILE]    check a YAML, TOML or JSON config, or --json STRING
    kvtier config show [FILE]        the effective config and where each value came from
    kvtier config schema             JSON Schema of the config, plugin models included
    kvtier config reference          the config reference as Markdown
    kvtier bench copy ...            copy backend benchmark (kvtier.copy.bench)
    kvtier simulate ...              eviction policy trace replay (kvtier.simulator)
    kvtier serve ...                 vLLM's OpenAI server with kvtier (kvtier.integrations.serve)

Exit status: 0 on success, 2 for an invalid configuration or command line,
1 when the plugins cannot be loaded or a delegated command fails to start.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.config import (
    CONFIG_FILE_ENV,
    MAX_CONFIG_DEPTH,
    ConfigError,
    Problem,
    config_json_schema,
    format_bytes,
    load_config,
    parse_bytes,
)
from kvtier.config_reference import render_config_reference
from kvtier.integrations import serve as vllm_serve
from kvtier.kinds import KINDS
from kvtier.plugins import PluginError, default_registry

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

DELEGATED: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "copy"): ("kvtier.copy.bench", "benchmark copy backends"),
    ("simulate",): ("kvtier.simulator", "replay a trace through eviction policies"),
}
"""Commands implemented elsewhere: words -> (module with add_arguments/run, summary)."""


def _command_plugins(args: argparse.Namespace) -> int:
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


def format_table(rows: list[list[str]]) -> str:
    """Align ``rows`` (the first one a header) in columns two spaces apart."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _command_config_validate(args: argparse.Namespace) -> int:
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


def _command_config_show(args: argparse.Namespace) -> int:
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


def _command_config_schema(args: argparse.Namespace) -> int:
    print(json.dumps(config_json_schema(), indent=2))
    return EXIT_OK


def _command_config_reference(args: argparse.Namespace) -> int:
    distribution = None if args.all else "kvtier"
    print(render_config_reference(default_registry(), distribution=distribution), end="")
    return EXIT_OK


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


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: a tiered KV-cache store for LLM inference engines.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level",
    )
    commands = _subcommands(parser, "command", "COMMAND")

    plugins = commands.add_parser("plugins", help="list the installed plugins")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plugins.set_defaults(handler=_command_plugins)

    config = commands.add_parser("config", help="validate, show or describe the configuration")
    config_commands = _subcommands(config, "config_command", "ACTION")
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
    validate.set_defaults(handler=_command_config_validate)
    show = config_commands.add_parser(
        "show", help="print the effective config and where each value came from"
    )
    show.add_argument("file", nargs="?", help="config file (default: $KVTIER_CONFIG, if set)")
    show.add_argument("--json", action="store_true", help="print JSON instead of a table")
    show.set_defaults(handler=_command_config_show)
    schema = config_commands.add_parser(
        "schema", help="print the JSON Schema of the config, plugin models included"
    )
    schema.set_defaults(handler=_command_config_schema)
    reference = config_commands.add_parser(
        "reference", help="print the config reference as Markdown"
    )
    reference.add_argument(
        "--all", action="store_true", help="include implementations from every installed plugin"
    )
    reference.set_defaults(handler=_command_config_reference)

    serve = commands.add_parser(
        "serve", help="start vLLM's OpenAI-compatible server with kvtier, on any vLLM build"
    )
    vllm_serve.add_arguments(serve)
    serve.set_defaults(handler=vllm_serve.run, passes_through=True)

    bench = commands.add_parser("bench", help="run a benchmark")
    bench_commands = _subcommands(bench, "bench_command", "WHAT")
    for words, (_, summary) in DELEGATED.items():
        group = bench_commands if words[0] == "bench" else commands
        stub = group.add_parser(words[-1], help=summary, add_help=False)
        stub.set_defaults(delegate=words)
    return parser


def _subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str) -> Any:
    """Add required subcommands to ``parser``, their help formatted by :class:`HelpFormatter`."""
    return parser.add_subparsers(
        dest=dest, required=True, metavar=metavar, parser_class=_SubcommandParser
    )


class _SubcommandParser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{"formatter_class": HelpFormatter, **kwargs})


class _Unavailable(Exception):
    """A delegated command's module is missing or does not provide its two functions."""


def _delegated_parser(
    words: tuple[str, ...],
) -> tuple[argparse.ArgumentParser, Callable[[argparse.Namespace], int]]:
    module_name, summary = DELEGATED[words]
    command = f"kvtier {' '.join(words)}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise _Unavailable(
                f"{command}: not available in this installation ({module_name} is missing)"
            ) from None
        raise
    add_arguments = getattr(module, "add_arguments", None)
    run = getattr(module, "run", None)
    if not (callable(add_arguments) and callable(run)):
        raise _Unavailable(
            f"{command}: {module_name} does not provide add_arguments(parser) and run(args); "
            "reinstall kvtier"
        )
    parser = argparse.ArgumentParser(
        prog=command, description=summary, formatter_class=HelpFormatter
    )
    add_arguments(parser)
    return parser, run


def _run_delegated(words: tuple[str, ...], argv: list[str]) -> int:
    try:
        parser, run = _delegated_parser(words)
    except _Unavailable as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILURE
    status: int = run(parser.parse_args(argv))
    return status


def check_output_file(path: str) -> None:
    """Check that a command can write a file at ``path``, before its work starts.

    Delegated commands call this for their output options, so a misspelt
    directory is reported at once rather than after a long run.

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


def help_texts() -> dict[str, str]:
    """Return the ``--help`` text of every command, keyed by its command line.

    Keys are full command lines such as ``"kvtier config show"``.

    Delegated commands are imported to build their parsers; one that is not
    available is described by the reason instead.
    """
    texts: dict[str, str] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        delegate = parser.get_default("delegate")
        if delegate is not None:
            try:
                texts[" ".join(words)] = _delegated_parser(delegate)[0].format_help()
            except _Unavailable as exc:
                texts[" ".join(words)] = f"{exc}\n"
            return
        texts[" ".join(words)] = parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*words, name))

    walk(_build_parser(), ("kvtier",))
    return texts


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvtier`` command line.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` if ``None``.

    Returns:
        The exit status.
    """
    parser = _build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    delegate = getattr(args, "delegate", None)
    try:
        if delegate is not None:
            return _run_delegated(delegate, rest)
        # kvtier serve hands what it does not know to vLLM.
        if getattr(args, "passes_through", False):
            args.vllm_args = rest
        elif rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except PluginError as exc:
        print(f"kvtier: cannot load plugins: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:
        # The reader went away (`kvtier config schema | head`); keep the exit quiet.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
