"""The ``kvtier`` command line: installed plugins, config validation, schema, benchmarks.

Subcommands::

    kvtier plugins [--json]          every registered implementation and who provides it
    kvtier config validate [FILE]    check a YAML, TOML or JSON config, or --json STRING
    kvtier config show [FILE]        the effective config and where each value came from
    kvtier config schema             JSON Schema of the config, plugin models included
    kvtier config reference          the config reference as Markdown
    kvtier bench copy ...            copy backend benchmark (kvtier.cli.bench)
    kvtier bench codec ...           record codecs on a model's KV (kvtier.cli.bench_codec)
    kvtier simulate ...              eviction policy trace replay (kvtier.cli.simulate)
    kvtier serve ...                 vLLM's OpenAI server with kvtier (kvtier.integrations.serve)

Exit status: 0 on success, 2 for an invalid configuration or command line,
1 when the plugins cannot be loaded or a delegated command fails to start.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence

from kvtier import __version__
from kvtier.cli import config, plugins
from kvtier.cli.common import EXIT_FAILURE, EXIT_USAGE, HelpFormatter, subcommands
from kvtier.config import ConfigError
from kvtier.integrations import serve as vllm_serve
from kvtier.plugins import PluginError

logger = logging.getLogger(__name__)

DELEGATED: dict[tuple[str, ...], tuple[str, str]] = {
    ("bench", "copy"): ("kvtier.cli.bench", "benchmark copy backends"),
    ("bench", "codec"): ("kvtier.cli.bench_codec", "measure record codecs on a model's KV"),
    ("simulate",): ("kvtier.cli.simulate", "replay a trace through eviction policies"),
}
"""Commands whose modules (torch and the simulator behind them) import only when run or
described: words -> (module with add_arguments/run, summary)."""


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
    commands = subcommands(parser, "command", "COMMAND")

    plugins.add_commands(commands)
    config.add_commands(commands)

    serve = commands.add_parser(
        "serve", help="start vLLM's OpenAI-compatible server with kvtier, on any vLLM build"
    )
    vllm_serve.add_arguments(serve)
    serve.set_defaults(handler=vllm_serve.run, passes_through=True)

    bench = commands.add_parser("bench", help="run a benchmark")
    bench_commands = subcommands(bench, "bench_command", "WHAT")
    for words, (_, summary) in DELEGATED.items():
        group = bench_commands if words[0] == "bench" else commands
        stub = group.add_parser(words[-1], help=summary, add_help=False)
        stub.set_defaults(delegate=words)
    return parser


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
