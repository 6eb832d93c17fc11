"""Tests of the plugin manager: loading entry points, registration checks, KVTIER_LOAD_PLUGINS."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from typing import Any, Literal

import pluggy
import pytest

import kvtier
from kvtier import hookspecs, plugins
from kvtier.config import PluginConfig
from kvtier.index.lru import LRUConfig
from kvtier.plugins import PluginError, build_plugin_manager, collect


class EchoConfig(PluginConfig):
    """Config of a copy backend that returns what it was built with."""

    type: Literal["echo"] = "echo"


def build_echo(config: EchoConfig, layout: Any, host_buffer: Any) -> tuple[Any, ...]:
    return (config, layout, host_buffer)


class EchoBackend:
    @kvtier.hookimpl
    def register_copy_backends(self, register: hookspecs.Register) -> None:
        register("echo", build_echo, EchoConfig)


class SecondLRU:
    @kvtier.hookimpl
    def register_block_indexes(self, register: hookspecs.Register) -> None:
        register("lru", lambda config, num_slots: None, LRUConfig)


class Misspelt:
    @kvtier.hookimpl
    def register_copy_backend(self, register: hookspecs.Register) -> None:
        register("echo", build_echo, EchoConfig)


@dataclass(frozen=True)
class FakeDistribution:
    name: str
    version: str


@dataclass(frozen=True)
class FakeEntryPoint:
    """What importlib.metadata yields, with a plugin object (or an import error) to load."""

    name: str
    value: str
    dist: FakeDistribution
    target: Any

    def load(self) -> Any:
        if isinstance(self.target, Exception):
            raise self.target
        return self.target


def entry_point(name: str, target: Any, dist: str = "kvtier-fake", version: str = "1.2.3") -> Any:
    return FakeEntryPoint(
        name, f"{dist.replace('-', '_')}.plugin", FakeDistribution(dist, version), target
    )


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The entry points the plugin manager sees in this test (none unless a test adds some)."""
    found: list[Any] = []
    monkeypatch.setattr(plugins, "entry_points", lambda group: list(found))
    return found


def fresh_manager(*objects: object) -> pluggy.PluginManager:
    pm = pluggy.PluginManager("kvtier")
    pm.add_hookspecs(hookspecs)
    for plugin in objects:
        pm.register(plugin)
    return pm


def test_builtins_load_without_any_installed_plugin(installed: list[Any]) -> None:
    registry = collect(build_plugin_manager(env={}))
    lru = registry.get("block_indexes", "lru")
    assert (lru.plugin, lru.distribution, lru.version) == (
        "kvtier.index.plugin",
        "kvtier",
        kvtier.__version__,
    )


def test_entry_point_plugin_is_registered_with_its_distribution(installed: list[Any]) -> None:
    installed.append(entry_point("echo", EchoBackend()))
    registry = collect(build_plugin_manager(env={}))
    echo = registry.get("copy_backends", "echo")
    assert (echo.plugin, echo.distribution, echo.version) == ("echo", "kvtier-fake", "1.2.3")
    assert registry.build("copy_backends", EchoConfig(), "layout", "buffer") == (
        EchoConfig(),
        "layout",
        "buffer",
    )


def test_failing_import_names_distribution_and_version(installed: list[Any]) -> None:
    installed.append(entry_point("broken", ImportError("No module named 'cuda'")))
    with pytest.raises(PluginError) as caught:
        build_plugin_manager(env={})
    assert str(caught.value) == (
        "plugin 'broken' (kvtier-fake 1.2.3) failed to import kvtier_fake.plugin: "
        "ImportError: No module named 'cuda'"
    )


def test_duplicate_name_names_both_owners(installed: list[Any]) -> None:
    installed.append(entry_point("second", SecondLRU(), dist="kvtier-lru", version="0.3"))
    with pytest.raises(PluginError) as caught:
        collect(build_plugin_manager(env={}))
    assert str(caught.value) == (
        f"block index 'lru' is registered twice: by plugin 'kvtier.index.plugin' "
        f"(kvtier {kvtier.__version__}) and by plugin 'second' (kvtier-lru 0.3)"
    )


def test_two_distributions_with_one_plugin_name_are_rejected(installed: list[Any]) -> None:
    installed.append(entry_point("echo", EchoBackend(), dist="kvtier-echo", version="1.0"))
    installed.append(entry_point("echo", EchoBackend(), dist="kvtier-echo-fork", version="2.0"))
    with pytest.raises(PluginError) as caught:
        build_plugin_manager(env={})
    assert str(caught.value) == (
        "two plugins are named 'echo': one from kvtier-echo 1.0, one from kvtier-echo-fork 2.0; "
        "uninstall one of them"
    )


def test_one_distribution_seen_twice_loads_once(installed: list[Any]) -> None:
    installed.extend([entry_point("echo", EchoBackend()), entry_point("echo", EchoBackend())])
    registry = collect(build_plugin_manager(env={}))
    assert registry.get("copy_backends", "echo").distribution == "kvtier-fake"


def test_misspelt_hook_names_distribution_and_version(installed: list[Any]) -> None:
    installed.append(entry_point("typo", Misspelt(), dist="kvtier-typo", version="2.0"))
    with pytest.raises(PluginError) as caught:
        build_plugin_manager(env={})
    message = str(caught.value)
    assert message.startswith("plugin 'typo' (kvtier-typo 2.0) implements a hook kvtier does not")
    assert "register_copy_backend" in message


def test_hook_that_raises_names_distribution_and_version(installed: list[Any]) -> None:
    class Raising:
        @kvtier.hookimpl
        def register_copy_backends(self, register: hookspecs.Register) -> None:
            raise RuntimeError("driver too old")

    installed.append(entry_point("raising", Raising(), dist="kvtier-raise", version="0.1"))
    with pytest.raises(PluginError) as caught:
        collect(build_plugin_manager(env={}))
    assert str(caught.value) == (
        "plugin 'raising' (kvtier-raise 0.1) failed in register_copy_backends: "
        "RuntimeError: driver too old"
    )


def test_config_model_must_be_a_plugin_config_with_a_matching_literal() -> None:
    class NotAModel:
        @kvtier.hookimpl
        def register_copy_backends(self, register: hookspecs.Register) -> None:
            register("echo", build_echo, dict)

    class WrongLiteral:
        @kvtier.hookimpl
        def register_copy_backends(self, register: hookspecs.Register) -> None:
            register("other", build_echo, EchoConfig)

    with pytest.raises(PluginError, match="not a kvtier.config.PluginConfig subclass"):
        collect(fresh_manager(NotAModel()))
    with pytest.raises(PluginError, match=r"declare it as Literal\['other'\]"):
        collect(fresh_manager(WrongLiteral()))


def test_name_and_factory_are_checked() -> None:
    class Nameless:
        @kvtier.hookimpl
        def register_copy_backends(self, register: hookspecs.Register) -> None:
            register("", build_echo, EchoConfig)

    class NotCallable:
        @kvtier.hookimpl
        def register_copy_backends(self, register: hookspecs.Register) -> None:
            register("echo", "build_echo", EchoConfig)

    with pytest.raises(PluginError, match="registered a copy backend without a name"):
        collect(fresh_manager(Nameless()))
    with pytest.raises(PluginError, match="copy backend 'echo' with a non-callable factory"):
        collect(fresh_manager(NotCallable()))


def test_load_plugins_env_selects_by_plugin_or_distribution_name(installed: list[Any]) -> None:
    installed.append(entry_point("echo", EchoBackend(), dist="kvtier-echo"))
    installed.append(entry_point("broken", ImportError("never imported"), dist="kvtier-broken"))
    for selection in ("echo", "kvtier-echo", " echo , "):
        registry = collect(build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": selection}))
        assert {reg.distribution for reg in registry.all()} == {"kvtier", "kvtier-echo"}
        assert registry.get("copy_backends", "echo").distribution == "kvtier-echo"


def test_empty_load_plugins_env_loads_only_the_builtins(installed: list[Any]) -> None:
    installed.append(entry_point("broken", ImportError("never imported")))
    registry = collect(build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": ""}))
    assert {reg.distribution for reg in registry.all()} == {"kvtier"}


def test_load_plugins_env_warns_about_unknown_names(
    installed: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvtier.plugins"):
        build_plugin_manager(env={"KVTIER_LOAD_PLUGINS": "nonesuch"})
    assert "KVTIER_LOAD_PLUGINS names 'nonesuch', but no such plugin is installed" in caplog.text


def test_registry_get_lists_installed_choices() -> None:
    registry = collect(fresh_manager(EchoBackend()))
    with pytest.raises(PluginError, match=r"no copy backend named 'dma'; installed: echo"):
        registry.get("copy_backends", "dma")
    with pytest.raises(PluginError, match=r"no storage tier named 'disk'; installed: none"):
        registry.get("storage_tiers", "disk")
    with pytest.raises(PluginError, match="unknown plugin kind 'copies'"):
        registry.of_kind("copies")


def test_example_plugin_is_discovered_through_its_entry_point() -> None:
    try:
        example = distribution("kvtier-example")
    except PackageNotFoundError:
        pytest.skip("kvtier-example is not installed (pip install -e plugins/kvtier-example)")
    registry = collect(build_plugin_manager(env={}))
    fifo = registry.get("block_indexes", "fifo")
    assert (fifo.distribution, fifo.version) == ("kvtier-example", example.version)
