"""Plugin manager: loads the built-in and installed plugins and collects what they register."""

from __future__ import annotations

import importlib
import logging
import os
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import pluggy

from kvtier import __version__, hookspecs
from kvtier.config import PluginConfig

logger = logging.getLogger(__name__)

PROJECT = "kvtier"
ENTRY_POINT_GROUP = "kvtier"
LOAD_PLUGINS_ENV = "KVTIER_LOAD_PLUGINS"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "kvtier.layout.plugin",
    "kvtier.copy.plugin",
    "kvtier.index.plugin",
    "kvtier.tiers.plugin",
)
"""Modules of the built-in plugins, registered through the same hooks as any other plugin."""

KINDS: dict[str, str] = {
    "layout_resolvers": "register_layout_resolvers",
    "copy_backends": "register_copy_backends",
    "block_indexes": "register_block_indexes",
    "storage_tiers": "register_storage_tiers",
}
"""Registry kind -> the hook that fills it."""

KIND_TITLES: dict[str, str] = {
    "layout_resolvers": "layout resolver",
    "copy_backends": "copy backend",
    "block_indexes": "block index",
    "storage_tiers": "storage tier",
}
"""Registry kind -> what one of its implementations is called in messages."""


class PluginError(Exception):
    """A plugin could not be loaded or registered something invalid."""


@dataclass(frozen=True)
class Registration:
    """One implementation a plugin registered."""

    kind: str
    name: str
    factory: Callable[..., Any]
    config_model: type[PluginConfig]
    plugin: str
    distribution: str
    version: str


@dataclass(frozen=True)
class Registry:
    """Everything the loaded plugins registered, by kind and then by name."""

    layout_resolvers: Mapping[str, Registration] = field(default_factory=dict)
    copy_backends: Mapping[str, Registration] = field(default_factory=dict)
    block_indexes: Mapping[str, Registration] = field(default_factory=dict)
    storage_tiers: Mapping[str, Registration] = field(default_factory=dict)

    def of_kind(self, kind: str) -> Mapping[str, Registration]:
        """Return the registrations of ``kind`` (one of :data:`KINDS`) by name."""
        if kind not in KINDS:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        return typing.cast(Mapping[str, Registration], getattr(self, kind))

    def get(self, kind: str, name: str) -> Registration:
        """Return the registration of ``name``; the error lists the installed choices."""
        found = self.of_kind(kind)
        if name not in found:
            choices = ", ".join(sorted(found)) or "none"
            raise PluginError(f"no {KIND_TITLES[kind]} named {name!r}; installed: {choices}")
        return found[name]

    def build(self, kind: str, config: PluginConfig, *args: Any) -> Any:
        """Build the implementation ``config.type`` of ``kind`` with its validated config."""
        return self.get(kind, config.type).factory(config, *args)

    def all(self) -> list[Registration]:
        """Return every registration, kind by kind in the order of :data:`KINDS`."""
        return [reg for kind in KINDS for reg in self.of_kind(kind).values()]


def _selected_entry_points(env: Mapping[str, str]) -> list[Any]:
    eps = list(entry_points(group=ENTRY_POINT_GROUP))
    if LOAD_PLUGINS_ENV not in env:
        return eps
    wanted = {name.strip() for name in env[LOAD_PLUGINS_ENV].split(",") if name.strip()}
    names = {ep.name for ep in eps} | {ep.dist.name for ep in eps if ep.dist is not None}
    for missing in sorted(wanted - names):
        logger.warning("%s names %r, but no such plugin is installed", LOAD_PLUGINS_ENV, missing)
    return [
        ep for ep in eps if ep.name in wanted or (ep.dist is not None and ep.dist.name in wanted)
    ]


def _owner(ep: Any) -> tuple[str, str]:
    if ep.dist is None:
        return ("unknown distribution", "unknown version")
    return (ep.dist.name, ep.dist.version)


def build_plugin_manager(env: Mapping[str, str] | None = None) -> pluggy.PluginManager:
    """Build a fresh plugin manager with the built-ins and the selected entry-point plugins.

    ``KVTIER_LOAD_PLUGINS`` (a comma list of plugin or distribution names; empty
    loads none) limits which installed plugins load; the built-ins always load.
    """
    env = os.environ if env is None else env
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    owners: dict[str, tuple[str, str]] = {name: (PROJECT, __version__) for name in DEFAULT_PLUGINS}
    for ep in _selected_entry_points(env):
        dist, version = _owner(ep)
        if pm.has_plugin(ep.name):
            first_dist, first_version = owners[ep.name]
            if first_dist == dist:
                continue  # the same distribution seen twice on sys.path
            raise PluginError(
                f"two plugins are named {ep.name!r}: one from {first_dist} {first_version}, "
                f"one from {dist} {version}; uninstall one of them"
            )
        try:
            plugin = ep.load()
        except Exception as exc:  # a plugin's import can raise anything
            raise PluginError(
                f"plugin {ep.name!r} ({dist} {version}) failed to import {ep.value}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        try:
            pm.register(plugin, name=ep.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {ep.name!r} ({dist} {version}) is invalid: {exc}") from exc
        owners[ep.name] = (dist, version)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) or "?"
        dist, version = owners.get(name, ("unknown distribution", "unknown version"))
        raise PluginError(
            f"plugin {name!r} ({dist} {version}) implements a hook kvtier does not know: {exc}"
        ) from exc
    pm.kvtier_owners = owners  # type: ignore[attr-defined]
    return pm


def _check_config_model(kind: str, name: str, config_model: Any, owner: str) -> None:
    if not (isinstance(config_model, type) and issubclass(config_model, PluginConfig)):
        raise PluginError(
            f"{owner} registered {KIND_TITLES[kind]} {name!r} with config model {config_model!r}, "
            "which is not a kvtier.config.PluginConfig subclass"
        )
    annotation = config_model.model_fields["type"].annotation
    if typing.get_origin(annotation) is not typing.Literal or typing.get_args(annotation) != (
        name,
    ):
        raise PluginError(
            f"{owner} registered {KIND_TITLES[kind]} {name!r}, but {config_model.__name__}.type is "
            f"{annotation!r}; declare it as Literal[{name!r}]"
        )


def collect(pm: pluggy.PluginManager) -> Registry:
    """Call every registration hook and return what was registered."""
    owners: dict[str, tuple[str, str]] = getattr(pm, "kvtier_owners", {})
    found: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}
    for kind, hook_name in KINDS.items():
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            dist, version = owners.get(
                impl.plugin_name, ("unknown distribution", "unknown version")
            )
            owner = f"plugin {impl.plugin_name!r} ({dist} {version})"

            def register(
                name: str,
                factory: Callable[..., Any],
                config_model: type[PluginConfig],
                *,
                _kind: str = kind,
                _impl: Any = impl,
                _owner: str = owner,
                _dist: str = dist,
                _version: str = version,
            ) -> None:
                if not isinstance(name, str) or not name:
                    raise PluginError(f"{_owner} registered a {KIND_TITLES[_kind]} without a name")
                if not callable(factory):
                    raise PluginError(
                        f"{_owner} registered {KIND_TITLES[_kind]} {name!r} "
                        "with a non-callable factory"
                    )
                _check_config_model(_kind, name, config_model, _owner)
                if name in found[_kind]:
                    first = found[_kind][name]
                    raise PluginError(
                        f"{KIND_TITLES[_kind]} {name!r} is registered twice: by plugin "
                        f"{first.plugin!r} ({first.distribution} {first.version}) and by {_owner}"
                    )
                found[_kind][name] = Registration(
                    _kind, name, factory, config_model, _impl.plugin_name, _dist, _version
                )

            try:
                impl.function(**{arg: register for arg in impl.argnames})
            except PluginError:
                raise
            except Exception as exc:  # a plugin's hook can raise anything
                raise PluginError(
                    f"{owner} failed in {hook_name}: {type(exc).__name__}: {exc}"
                ) from exc
    return Registry(**found)


_default_registry: Registry | None = None


def default_registry() -> Registry:
    """The registry of this process's plugins, built on first use."""
    global _default_registry
    if _default_registry is None:
        _default_registry = collect(build_plugin_manager())
    return _default_registry
