"""Tests of the plugin manager: loading entry points, registration checks, KVTIER_LOAD_PLUGINS."""

from __future__ import annotations

import ast
import importlib.util
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import Any, Literal

import pluggy
import pytest

import kvtier
from kvtier import api, hookspecs, plugins
from kvtier.api import (
    BLOCK_INDEX,
    COPY_BACKEND,
    EVICTION_POLICY,
    LAYOUT_RESOLVER,
    RECORD_CODEC,
    STORAGE_TIER,
    Kind,
    LazyFactory,
    PluginConfig,
    PolicyIndex,
)
from kvtier.index.lru import LRUConfig, LRUPolicy
from kvtier.kinds import KINDS
from kvtier.plugins import LOAD_PLUGINS_ENV, PluginError, build_plugin_manager, collect


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
    def register_eviction_policies(self, register: hookspecs.Register) -> None:
        register("lru", lambda config, num_slots: None, LRUConfig)


class LRUIndex:
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

    @property
    def metadata(self) -> dict[str, str]:
        return {"name": self.name}


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
    lru = registry.get(BLOCK_INDEX, "lru")
    assert (lru.plugin, lru.distribution, lru.version) == (
        "kvtier.default_plugins.eviction_policies",
        "kvtier",
        kvtier.__version__,
    )


def test_entry_point_plugin_is_registered_with_its_distribution(installed: list[Any]) -> None:
    installed.append(entry_point("echo", EchoBackend()))
    registry = collect(build_plugin_manager(env={}))
    echo = registry.get(COPY_BACKEND, "echo")
    assert (echo.plugin, echo.distribution, echo.version) == ("echo", "kvtier-fake", "1.2.3")
    assert registry.build(COPY_BACKEND, EchoConfig(), "layout", "buffer") == (
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
        "eviction policy 'lru' is registered twice: "
        "by plugin 'kvtier.default_plugins.eviction_policies' "
        f"(kvtier {kvtier.__version__}) and by plugin 'second' (kvtier-lru 0.3)"
    )


def test_a_block_index_may_not_take_an_eviction_policys_name(installed: list[Any]) -> None:
    installed.append(entry_point("mine", LRUIndex(), dist="kvtier-mine", version="0.3"))
    with pytest.raises(PluginError) as caught:
        collect(build_plugin_manager(env={}))
    assert str(caught.value) == (
        "block index 'lru' is registered twice: as a block index by plugin 'mine' "
        "(kvtier-mine 0.3) and as an eviction policy "
        "by plugin 'kvtier.default_plugins.eviction_policies' "
        f"(kvtier {kvtier.__version__}); rename one of them"
    )


def test_an_eviction_policy_is_a_block_index_of_the_same_name() -> None:
    registry = collect(build_plugin_manager(env={LOAD_PLUGINS_ENV: ""}))
    policy = registry.get(EVICTION_POLICY, "lru")
    index_registration = registry.get(BLOCK_INDEX, "lru")
    assert (index_registration.config_model, index_registration.plugin) == (
        policy.config_model,
        policy.plugin,
    )
    index = registry.build(BLOCK_INDEX, LRUConfig(), 4)
    assert isinstance(index, PolicyIndex) and isinstance(index.policy, LRUPolicy)
    assert index.num_slots == 4


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
    assert registry.get(COPY_BACKEND, "echo").distribution == "kvtier-fake"


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

    with pytest.raises(PluginError, match="not a kvtier.api.PluginConfig subclass"):
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
        assert registry.get(COPY_BACKEND, "echo").distribution == "kvtier-echo"


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
        registry.get(COPY_BACKEND, "dma")
    with pytest.raises(PluginError, match=r"no storage tier named 'disk'; installed: none"):
        registry.get(STORAGE_TIER, "disk")


def test_kind_names_still_work_with_a_deprecation_warning() -> None:
    registry = collect(fresh_manager(EchoBackend()))
    with pytest.warns(DeprecationWarning, match=r"pass kvtier.api.COPY_BACKEND") as caught:
        assert registry.get("copy_backends", "echo") is registry.get(COPY_BACKEND, "echo")
    assert caught[0].filename == __file__
    with pytest.warns(DeprecationWarning, match=r"'block_indexes' is deprecated"):
        assert registry.block_indexes == {}
    with pytest.warns(DeprecationWarning):
        assert registry.build("copy_backends", EchoConfig(), 1, 2) == (EchoConfig(), 1, 2)
    with pytest.raises(PluginError, match="unknown plugin kind 'copies'"):
        registry.of_kind("copies")
    with pytest.raises(AttributeError, match="has no attribute 'copies'"):
        registry.copies  # noqa: B018


def test_example_plugin_is_discovered_through_its_entry_point() -> None:
    try:
        example = distribution("kvtier-example")
    except PackageNotFoundError:
        pytest.skip("kvtier-example is not installed (pip install -e plugins/kvtier-example)")
    registry = collect(build_plugin_manager(env={}))
    fifo = registry.get(BLOCK_INDEX, "fifo")
    assert (fifo.distribution, fifo.version) == ("kvtier-example", example.version)


def test_registration_hooks_are_called_through_pluggy(installed: list[Any]) -> None:
    installed.append(entry_point("echo", EchoBackend()))
    pm = build_plugin_manager(env={})
    calls: list[tuple[str, list[str]]] = []
    pm.add_hookcall_monitoring(
        lambda hook_name, impls, kwargs: calls.append(
            (hook_name, [impl.plugin_name for impl in impls])
        ),
        lambda outcome, hook_name, impls, kwargs: None,
    )
    collect(pm)
    assert calls == [
        ("register_codecs", ["kvtier.default_plugins.codecs"]),
        ("register_copy_backends", ["kvtier.default_plugins.copy_backends"]),
        ("register_copy_backends", ["echo"]),
        ("register_eviction_policies", ["kvtier.default_plugins.eviction_policies"]),
        ("register_layout_resolvers", ["kvtier.default_plugins.layout_resolvers"]),
        ("register_storage_tiers", ["kvtier.default_plugins.storage_tiers"]),
    ]


def test_entry_point_distributions_are_pluggys_distinfo(installed: list[Any]) -> None:
    echo = EchoBackend()
    installed.append(entry_point("echo", echo, dist="kvtier-echo", version="1.0"))
    pm = build_plugin_manager(env={})
    assert [
        (plugin, dist.project_name, dist.version) for plugin, dist in pm.list_plugin_distinfo()
    ] == [(echo, "kvtier-echo", "1.0")]


def test_distinfo_of_a_manager_built_elsewhere_names_the_owner() -> None:
    pm = fresh_manager()
    backend = EchoBackend()
    pm.register(backend, name="echo")
    pm._plugin_distinfo.append((backend, FakeDistribution("kvtier-echo", "4.5")))
    echo = collect(pm).get(COPY_BACKEND, "echo")
    assert (echo.plugin, echo.distribution, echo.version) == ("echo", "kvtier-echo", "4.5")


def test_every_kind_has_its_hook_and_every_hook_its_kind() -> None:
    specs = {name for name in dir(hookspecs) if hasattr(getattr(hookspecs, name), "kvtier_spec")}
    assert [kind.hook for kind in KINDS] == sorted(specs)
    for kind in KINDS:
        constant = kind.title.upper().replace(" ", "_")  # what the deprecation warning names
        assert getattr(api, constant) is kind
        assert getattr(api, kind.factory.__name__) is kind.factory


def test_builtin_lazy_factories_name_functions_their_modules_define() -> None:
    registry = collect(build_plugin_manager(env={LOAD_PLUGINS_ENV: ""}))
    lazy = [reg for reg in registry.all() if isinstance(reg.factory, LazyFactory)]
    assert {reg.kind for reg in lazy} == {RECORD_CODEC, COPY_BACKEND, LAYOUT_RESOLVER, STORAGE_TIER}
    for reg in lazy:
        # Read, not imported: importing them is what the lazy factories avoid (torch, CUDA).
        spec = importlib.util.find_spec(reg.factory.module)
        assert spec is not None and spec.origin is not None, reg.factory
        tree = ast.parse(Path(spec.origin).read_text())
        functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert reg.factory.attribute in functions, reg.factory


def test_lazy_factory_names_what_is_missing() -> None:
    with pytest.raises(ImportError, match=r"cannot import name 'nonesuch' from 'kvtier.kinds'"):
        LazyFactory("kvtier.kinds", "nonesuch")(1)
    assert LazyFactory("kvtier.kinds", "Kind").load() is Kind
