"""What the config tests share with the CLI, reliability and schema tests: stand-in plugins
with small configs, a registry of them, and the bad inputs each refuses. The schema test checks
that the published JSON schema refuses every bad input here that a schema can see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import pluggy
import pytest
from pydantic import Field

import kvtier
from kvtier import hookspecs
from kvtier.config import PluginConfig
from kvtier.index.lru import LRUConfig
from kvtier.index.prefix_arc import PrefixARCConfig
from kvtier.kinds import COPY_BACKEND
from kvtier.plugins import Registry, collect


class TorchConfig(PluginConfig):
    """Stand-in for the default copy backend's config."""

    type: Literal["torch"] = "torch"
    streams: int = Field(1, gt=0, description="Copy streams.")


class TwinConfig(PluginConfig):
    """A second copy backend, to switch to."""

    type: Literal["twin"] = "twin"
    depth: int = Field(2, description="Queue depth.")


class AutoConfig(PluginConfig):
    """Stand-in for the default layout resolver's config."""

    type: Literal["auto"] = "auto"


class Sections:
    """A copy backend, a layout resolver and two indexes with the stand-in configs."""

    @kvtier.hookimpl
    def register_copy_backends(self, register: hookspecs.Register) -> None:
        register("torch", lambda config, layout, host: ("torch", config), TorchConfig)
        register("twin", lambda config, layout, host: ("twin", config), TwinConfig)

    @kvtier.hookimpl
    def register_layout_resolvers(self, register: hookspecs.Register) -> None:
        register("auto", lambda config: ("auto", config), AutoConfig)

    @kvtier.hookimpl
    def register_block_indexes(self, register: hookspecs.Register) -> None:
        register("lru", lambda config, num_slots: ("lru", num_slots), LRUConfig)
        register("prefix_arc", lambda config, num_slots: ("prefix_arc", num_slots), PrefixARCConfig)


def make_registry(*plugins: object) -> Registry:
    """The registry of ``plugins`` alone, in a plugin manager of its own."""
    pm = pluggy.PluginManager("kvtier")
    pm.add_hookspecs(hookspecs)
    for plugin in plugins:
        pm.register(plugin)
    return collect(pm)


@pytest.fixture
def registry() -> Registry:
    return make_registry(Sections())


BAD_EXPLICIT: dict[str, dict[str, Any]] = {
    "unknown type": {"copy": {"type": "turbo"}},
    "unknown keys": {"cpu_byte": 5, "copy": {"stream": 2}},
    "zero size": {"cpu_bytes_per_rank": 0},
    "negative size": {"cpu_bytes_per_rank": -1},
    "zero size with a unit": {"cpu_bytes_per_rank": "0GiB"},
    "deadlines": {"copy_deadline_s": 0, "report_deadline_s": "soon", "close_timeout_s": 7200},
    "wrong types": {"store_mode": 3, "cpu_bytes": [1], "copy": {"streams": "many"}},
    "no plugin installed": {"copy": {"type": "torch"}},
}
"""Bad explicit values, each refused by its test in test_config.py (against the ``registry``
fixture, or with no plugin at all for ``no plugin installed``)."""


LONG_VALUES: dict[str, tuple[Callable[[], object], str]] = {
    "long string": (lambda: "x" * 10_000_000, "'" + "x" * 30),
    "long list": (lambda: list(range(5000)), "[0, 1, 2, 3, 4, 5, ...]"),
    "huge integer": (lambda: 10**5000, "<a 16610-bit integer>"),
    "long integer": (lambda: -(10**90), "-100000000000"),
}
"""Values under an unknown key, ``bogus``, and how the error line starts to show them."""


NATIVE_BOUNDS = [
    (COPY_BACKEND, "torch", "cpu_threads", 10**6),
    (COPY_BACKEND, "torch", "cuda_staging_bytes", 2**63),
    (COPY_BACKEND, "dma", "stream_priority", 2**31),
    (COPY_BACKEND, "kernel", "stream_priority", -(2**31) - 1),
]
"""Settings of the built-in plugins one past what native code takes: (kind, type, key, value)."""


BAD_FILES = {
    "unknown type": (
        "copy:\n  type: turbo\n",
        "copy.type: unknown copy backend type; installed: torch, twin (got 'turbo')",
    ),
    "unknown key": (
        "cpu_bytez: 1\n",
        "cpu_bytez: unknown key; valid keys here: close_timeout_s, copy, copy_deadline_s, "
        "cost_guard, cost_guard_margin, cpu_bytes, cpu_bytes_per_rank, flush_deadline_s, index, "
        "layout, namespace, pin_max_s, pin_share, prefetch, report_deadline_s, "
        "same_step_load_bytes, store_mode, tiers (got 1)",
    ),
    "negative size": ("cpu_bytes: -8\n", "cpu_bytes: Input should be greater than 0 (got -8)"),
    "zero size": ("cpu_bytes_per_rank: 0\n", "cpu_bytes_per_rank: Input should be greater than 0"),
    "wrong type": ("store_mode: [eager]\n", "store_mode: Input should be 'eager' or 'lazy'"),
    "unparseable": ("copy: {type: torch\n", "(file): cannot parse YAML: "),
}
"""Bad config files, each refused by ``kvtier config validate`` in test_cli.py with the line
that follows it (against :func:`make_registry` of :class:`Sections`)."""


FLOAT_FILES = {
    "YAML": (
        "kvtier.yaml",
        "index:\n  history_factor: .inf\n  low_value_ratio: .nan\n"
        "  first_sight_memory_factor: 1e308\n",
    ),
    "TOML": (
        "kvtier.toml",
        "[index]\nhistory_factor = inf\nlow_value_ratio = nan\nfirst_sight_memory_factor = 1e308\n",
    ),
}
"""Files whose floats are not finite or out of bounds, refused in test_config_inputs.py."""


NOT_POSITIVE_SIZES = "cpu_bytes: -1\ncpu_bytes_per_rank: 0\ncopy:\n  cuda_staging_bytes: 0GiB\n"
"""A file whose sizes are not positive, refused in test_config_inputs.py."""
