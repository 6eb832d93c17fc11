"""Plugin manager: loads the built-in and installed plugins and collects what they register.

Registration hooks are called through pluggy, one plugin at a time
(:meth:`pluggy.PluginManager.subset_hook_caller`), so ``add_hookcall_monitoring``
and pluggy's tracing see every call, and each plugin gets a ``register`` callable
that knows its :class:`Owner` for messages. Where an entry-point plugin comes
from is kept where pluggy keeps it (:meth:`~pluggy.PluginManager.list_plugin_distinfo`).
"""

from __future__ import annotations

import importlib
import logging
import os
import typing
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Generic

import pluggy

from kvtier import __version__, hookspecs
from kvtier.kinds import BLOCK_INDEX, EVICTION_POLICY, KINDS, BuiltT, Kind, PolicyIndexFactory
from kvtier.models import PluginConfig

logger = logging.getLogger(__name__)

PROJECT = "kvtier"
ENTRY_POINT_GROUP = "kvtier"
LOAD_PLUGINS_ENV = "KVTIER_LOAD_PLUGINS"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "kvtier.default_plugins.eviction_policies",
    "kvtier.default_plugins.copy_backends",
    "kvtier.default_plugins.layout_resolvers",
    "kvtier.default_plugins.storage_tiers",
    "kvtier.default_plugins.codecs",
)
"""Modules of the built-in plugins, registered through the same hooks as any other plugin."""

_KINDS_BY_NAME: dict[str, Kind[Any]] = {kind.name: kind for kind in KINDS}


class PluginError(Exception):
    """A plugin could not be loaded or registered something invalid."""


@dataclass(frozen=True)
class Owner:
    """Who provides a plugin: its name in the plugin manager, its distribution and version."""

    plugin: str
    distribution: str
    version: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} ({self.distribution} {self.version})"


def owner_of(pm: pluggy.PluginManager, plugin_name: str) -> Owner:
    """Return who provides the plugin registered as ``plugin_name``.

    The built-ins belong to kvtier; any other plugin's distribution comes from
    pluggy's record of the entry points it was loaded from.
    """
    if plugin_name in DEFAULT_PLUGINS:
        return Owner(plugin_name, PROJECT, __version__)
    plugin = pm.get_plugin(plugin_name)
    for loaded, dist in pm.list_plugin_distinfo():
        if loaded is plugin:
            return Owner(plugin_name, dist.project_name, dist.version)
    return Owner(plugin_name, "unknown distribution", "unknown version")


@dataclass(frozen=True)
class Registration(Generic[BuiltT]):
    """One implementation a plugin registered."""

    kind: Kind[BuiltT]
    name: str
    factory: Callable[..., BuiltT]
    config_model: type[PluginConfig]
    plugin: str
    distribution: str
    version: str


def _kind(kind: Kind[BuiltT] | str) -> Kind[BuiltT]:
    """``kind`` itself; a kind's name (the older spelling) is looked up, with a warning."""
    if isinstance(kind, Kind):
        return kind
    if kind not in _KINDS_BY_NAME:
        raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(_KINDS_BY_NAME)}")
    found = _KINDS_BY_NAME[kind]
    constant = found.title.upper().replace(" ", "_")
    warnings.warn(
        f"naming a plugin kind by the string {kind!r} is deprecated; pass kvtier.api.{constant}",
        DeprecationWarning,
        stacklevel=3,  # the caller of the Registry method
    )
    return found


@dataclass(frozen=True)
class Registry:
    """Everything the loaded plugins registered, by kind and then by name."""

    registrations: Mapping[Kind[Any], Mapping[str, Registration[Any]]]

    def of_kind(self, kind: Kind[BuiltT]) -> Mapping[str, Registration[BuiltT]]:
        """Return the registrations of ``kind`` (one of :data:`kvtier.kinds.KINDS`) by name."""
        return self.registrations.get(_kind(kind), {})

    def get(self, kind: Kind[BuiltT], name: str) -> Registration[BuiltT]:
        """Return the registration of ``name``; the error lists the installed choices."""
        kind = _kind(kind)
        found = self.of_kind(kind)
        if name not in found:
            choices = ", ".join(sorted(found)) or "none"
            raise PluginError(f"no {kind.title} named {name!r}; installed: {choices}")
        return found[name]

    def build(self, kind: Kind[BuiltT], config: PluginConfig, *args: Any) -> BuiltT:
        """Build the implementation ``config.type`` of ``kind`` with its validated config.

        ``config`` given as plain data (a section of a ``KVTierConfig`` built
        directly) is first validated against the implementation's own config model.
        ``args`` are the kind's other factory arguments (see :mod:`kvtier.kinds`).

        Raises:
            pydantic.ValidationError: ``config``'s settings are not valid for the
                implementation's config model.
        """
        registration = self.get(_kind(kind), config.type)
        if not isinstance(config, registration.config_model):
            config = registration.config_model.model_validate(config.model_dump(exclude_unset=True))
        return registration.factory(config, *args)

    def all(self) -> list[Registration[Any]]:
        """Return every registration, kind by kind in the order of :data:`kvtier.kinds.KINDS`."""
        return [reg for kind in KINDS for reg in self.of_kind(kind).values()]

    if not typing.TYPE_CHECKING:

        def __getattr__(self, name: str) -> Mapping[str, Registration[Any]]:
            # ``registry.block_indexes``: the attributes of the older registry, one per kind.
            if name not in _KINDS_BY_NAME:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            return self.of_kind(_kind(name))


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


def _load_entry_point(pm: pluggy.PluginManager, ep: Any) -> None:
    """Import ``ep``'s plugin and register it under the entry point's name."""
    dist, version = (
        ("unknown distribution", "unknown version")
        if ep.dist is None
        else (ep.dist.name, ep.dist.version)
    )
    if pm.has_plugin(ep.name):
        first = owner_of(pm, ep.name)
        if first.distribution == dist:
            return  # the same distribution seen twice on sys.path
        raise PluginError(
            f"two plugins are named {ep.name!r}: one from {first.distribution} {first.version}, "
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
    if ep.dist is not None:
        # What pluggy's own load_setuptools_entrypoints records, so list_plugin_distinfo()
        # names the distribution. That loader is not used because it cannot select by
        # distribution, skips a second distribution's plugin of the same name silently,
        # and lets an import error escape without naming the plugin.
        pm._plugin_distinfo.append((plugin, ep.dist))


def build_plugin_manager(env: Mapping[str, str] | None = None) -> pluggy.PluginManager:
    """Build a fresh plugin manager with the built-ins and the selected entry-point plugins.

    ``KVTIER_LOAD_PLUGINS`` (a comma list of plugin or distribution names; empty
    loads none) limits which installed plugins load; the built-ins always load.
    Nothing is called yet: :func:`collect` calls the registration hooks.
    """
    env = os.environ if env is None else env
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    for ep in _selected_entry_points(env):
        _load_entry_point(pm, ep)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        owner = owner_of(pm, pm.get_name(exc.plugin) or "?")
        raise PluginError(f"{owner} implements a hook kvtier does not know: {exc}") from exc
    return pm


def _check_config_model(kind: Kind[Any], name: str, config_model: Any, owner: Owner) -> None:
    if not (isinstance(config_model, type) and issubclass(config_model, PluginConfig)):
        raise PluginError(
            f"{owner} registered {kind.title} {name!r} with config model {config_model!r}, "
            "which is not a kvtier.api.PluginConfig subclass"
        )
    annotation = config_model.model_fields["type"].annotation
    if typing.get_origin(annotation) is not typing.Literal or typing.get_args(annotation) != (
        name,
    ):
        raise PluginError(
            f"{owner} registered {kind.title} {name!r}, but {config_model.__name__}.type is "
            f"{annotation!r}; declare it as Literal[{name!r}]"
        )


def _register_callable(
    kind: Kind[Any], owner: Owner, found: dict[str, Registration[Any]]
) -> Callable[[str, Callable[..., Any], type[PluginConfig]], None]:
    """The ``register`` one plugin's hook for ``kind`` receives: checks, then records."""

    def register(name: str, factory: Callable[..., Any], config_model: type[PluginConfig]) -> None:
        if not isinstance(name, str) or not name:
            raise PluginError(f"{owner} registered a {kind.title} without a name")
        if not callable(factory):
            raise PluginError(
                f"{owner} registered {kind.title} {name!r} with a non-callable factory"
            )
        _check_config_model(kind, name, config_model, owner)
        if name in found:
            first = found[name]
            raise PluginError(
                f"{kind.title} {name!r} is registered twice: by plugin {first.plugin!r} "
                f"({first.distribution} {first.version}) and by {owner}"
            )
        found[name] = Registration(
            kind, name, factory, config_model, owner.plugin, owner.distribution, owner.version
        )

    return register


def collect(pm: pluggy.PluginManager) -> Registry:
    """Call every registration hook, plugin by plugin in registration order; return the result."""
    found: dict[Kind[Any], dict[str, Registration[Any]]] = {kind: {} for kind in KINDS}
    for kind in KINDS:
        implementations = getattr(pm.hook, kind.hook).get_hookimpls()
        for impl in implementations:
            others = [other.plugin for other in implementations if other is not impl]
            owner = owner_of(pm, impl.plugin_name)
            try:
                pm.subset_hook_caller(kind.hook, others)(
                    register=_register_callable(kind, owner, found[kind])
                )
            except PluginError:
                raise
            except Exception as exc:  # a plugin's hook can raise anything
                raise PluginError(
                    f"{owner} failed in {kind.hook}: {type(exc).__name__}: {exc}"
                ) from exc
    _offer_policies_as_indexes(found[EVICTION_POLICY], found[BLOCK_INDEX])
    return Registry(found)


def _offer_policies_as_indexes(
    policies: Mapping[str, Registration[Any]], indexes: dict[str, Registration[Any]]
) -> None:
    """Add a block index per eviction policy: the policy in a ``PolicyIndex``, same name."""
    for name, policy in policies.items():
        if name in indexes:
            first = indexes[name]
            raise PluginError(
                f"{BLOCK_INDEX.title} {name!r} is registered twice: as a block index by plugin "
                f"{first.plugin!r} ({first.distribution} {first.version}) and as an eviction "
                f"policy by plugin {policy.plugin!r} ({policy.distribution} {policy.version}); "
                "rename one of them"
            )
        indexes[name] = Registration(
            BLOCK_INDEX,
            name,
            PolicyIndexFactory(policy.factory),
            policy.config_model,
            policy.plugin,
            policy.distribution,
            policy.version,
        )


_default_registry: Registry | None = None


def default_registry() -> Registry:
    """The registry of this process's plugins, built on first use."""
    global _default_registry
    if _default_registry is None:
        _default_registry = collect(build_plugin_manager())
    return _default_registry
