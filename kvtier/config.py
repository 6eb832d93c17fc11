"""Configuration: the models kvtier validates once at start-up, and where each value came from.

:func:`load_config` merges three sources, highest first:

1. explicit arguments (a dict; vLLM passes ``kv_connector_extra_config``),
2. ``KVTIER_*`` environment variables, nested with ``__``
   (``KVTIER_CPU_BYTES=16GiB``, ``KVTIER_COPY__TYPE=torch``),
3. a YAML or TOML file named by ``config_file`` (an argument or an explicit
   key) or by ``KVTIER_CONFIG``,

and validates the result against :func:`config_model`: the
:class:`KVTierConfig` fields with each pluggable section (``index``, ``copy``,
``layout``) narrowed to a discriminated union, on ``type``, of the config
models the installed plugins registered. Every problem becomes one line
``<source>: <dotted.path>: <message> (got <value>)`` of a :class:`ConfigError`.

Reading is bounded, because a config may come from anywhere: a file must be a
regular file of at most :data:`MAX_CONFIG_FILE_BYTES`, YAML aliases are
refused, every source may nest at most :data:`MAX_CONFIG_DEPTH` levels and hold
at most :data:`MAX_CONFIG_VALUES` values, numbers must be finite, and values
in error lines are cut short.
"""

from __future__ import annotations

import json
import os
import re
import reprlib
import stat
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

if TYPE_CHECKING:
    from kvtier.plugins import Registry

GiB = 1024**3
DEFAULT_CPU_BYTES = 8 * GiB
DEFAULT_COPY_DEADLINE_S = 10.0
DEFAULT_REPORT_DEADLINE_S = 30.0
DEFAULT_CLOSE_TIMEOUT_S = 10.0
ENV_PREFIX = "KVTIER_"
CONFIG_FILE_ENV = "KVTIER_CONFIG"
CONFIG_FILE_KEY = "config_file"
RESERVED_ENV: frozenset[str] = frozenset({CONFIG_FILE_ENV, "KVTIER_LOAD_PLUGINS"})
"""``KVTIER_*`` variables that are not configuration values."""
DEFAULT_SOURCE = "default"
EXPLICIT_SOURCE = "explicit"
MAX_CONFIG_FILE_BYTES = 1 << 20
"""Largest config file kvtier reads; a real one is a few hundred bytes."""
MAX_CONFIG_DEPTH = 32
"""Deepest nesting of mappings and lists in one config source."""
MAX_CONFIG_VALUES = 10_000
"""Most values (mappings, lists and scalars) one config source may hold."""
MEMINFO = "/proc/meminfo"
"""Where Linux reports memory; ``MemAvailable`` is what new allocations can get."""


class KVTierModel(BaseModel):
    """Base of every kvtier config model.

    Unknown keys are errors, values are immutable, and floats must be finite
    (``inf`` and ``nan`` are rejected, so no size or factor computed from one
    can overflow).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class PluginConfig(KVTierModel):
    """Base of a pluggable section's config; subclasses narrow ``type`` to ``Literal[name]``."""

    type: str = Field(description="Name of the registered implementation to use.")


@dataclass(frozen=True)
class Section:
    """A pluggable section of :class:`KVTierConfig` and the plugin kind that fills it."""

    field: str
    kind: str
    default: str
    description: str


SECTIONS: tuple[Section, ...] = (
    Section(
        "index",
        "block_indexes",
        "prefix_arc",
        "Block index of the host tier: maps block keys to slots and picks eviction victims.",
    ),
    Section(
        "copy",
        "copy_backends",
        "torch",
        "Copy backend that moves blocks between engine memory and the host tier.",
    ),
    Section(
        "layout",
        "layout_resolvers",
        "auto",
        "Layout resolver that maps the engine's KV tensors to block regions.",
    ),
)
"""The pluggable sections, with the implementation each uses when the config names none."""

_SECTIONS_BY_FIELD = {section.field: section for section in SECTIONS}

_SIZE_PATTERN = re.compile(r"^\s*(\d+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_bytes(value: Any) -> Any:
    """Turn a size such as ``"8GiB"``, ``"512 MB"`` or ``"4096"`` into a number of bytes.

    Integers pass through unchanged (range checks belong to the field); other
    types are returned as they are, for pydantic to reject with its own message.

    Args:
        value: An ``int`` or a string of digits with an optional unit
            (``B``, ``KB``, ``MB``, ``GB``, ``TB`` in powers of 1000;
            ``KiB``, ``MiB``, ``GiB``, ``TiB`` in powers of 1024).

    Returns:
        The number of bytes, or ``value`` unchanged when it is not a string.

    Raises:
        ValueError: ``value`` is a string that is not a size.
    """
    if isinstance(value, bool):
        raise ValueError("expected a number of bytes, not a boolean")
    if not isinstance(value, str):
        return value
    match = _SIZE_PATTERN.match(value)
    if match is None:
        raise ValueError("expected a number of bytes such as 8589934592, '8GiB' or '512MB'")
    number, unit = match.groups()
    return int(number) * _SIZE_UNITS[(unit or "b").lower()]


ByteCount = Annotated[
    int,
    BeforeValidator(parse_bytes, json_schema_input_type=int | str),
    Field(gt=0, le=2**63 - 1),
]
"""A positive number of bytes that fits a signed 64-bit size (what torch and CUDA take);
strings with a unit (``"8GiB"``, ``"512MB"``) are accepted."""


def _section_shorthand(value: Any) -> Any:
    """Accept ``copy: torch`` for ``copy: {type: torch}``."""
    return {"type": value} if isinstance(value, str) else value


# The section is called ``copy`` in every config source; the ``BaseModel.copy`` method it hides
# is deprecated in pydantic 2 (``model_copy`` replaces it).
_COPY_SHADOWS = r'Field name "copy" in "KVTierConfig" shadows an attribute'
warnings.filterwarnings("ignore", message=_COPY_SHADOWS, category=UserWarning)


def _default_section(field: str) -> PluginConfig:
    """The default implementation's config for a section, from the process's plugins."""
    from kvtier.plugins import default_registry

    section = _SECTIONS_BY_FIELD[field]
    registration = default_registry().get(section.kind, section.default)
    return registration.config_model.model_validate({})


class KVTierConfig(KVTierModel):
    """The validated kvtier configuration.

    Build it with :func:`load_config`, which validates the pluggable sections
    against the installed plugins and records where each value came from.
    Constructing it directly works with plugin config instances
    (``KVTierConfig(copy=TorchCopyConfig())``); omitted sections use their
    default implementation.
    """

    cpu_bytes: ByteCount = Field(
        DEFAULT_CPU_BYTES,
        description=(
            "Host (CPU DRAM) tier size in bytes for the whole server, split evenly over the "
            "engine's ranks (tensor- and pipeline-parallel workers). Accepts sizes such as "
            "'8GiB'."
        ),
    )
    cpu_bytes_per_rank: ByteCount | None = Field(
        None,
        description=(
            "Host tier size in bytes for each rank; when set it overrides the even split of "
            "cpu_bytes. Accepts sizes such as '2GiB'."
        ),
    )
    store_mode: Literal["eager", "lazy"] = Field(
        "eager",
        description=(
            "When blocks are copied to the host tier: 'eager' stores every newly computed full "
            "block; 'lazy' stores blocks only as the engine is about to evict them."
        ),
    )
    copy_deadline_s: float = Field(
        DEFAULT_COPY_DEADLINE_S,
        gt=0,
        le=3600,
        description=(
            "Seconds a copy between the engine and the host tier may run before its worker "
            "stops waiting: a load becomes a recompute, a store is dropped, and the copy's host "
            "slots stay out of use until it ends."
        ),
    )
    report_deadline_s: float = Field(
        DEFAULT_REPORT_DEADLINE_S,
        gt=0,
        le=3600,
        description=(
            "Seconds the scheduler waits for every rank to report a planned copy before it "
            "fails the copy (a load becomes a recompute, a store is dropped); its host slots "
            "stay out of use until every rank reported. Keep it above copy_deadline_s."
        ),
    )
    close_timeout_s: float = Field(
        DEFAULT_CLOSE_TIMEOUT_S,
        ge=0,
        le=3600,
        description=(
            "Seconds shutdown waits for copies still running; after it they are abandoned and "
            "the host tier's memory is deliberately not freed, so a late copy cannot write "
            "freed memory."
        ),
    )
    index: PluginConfig = Field(
        default_factory=partial(_default_section, "index"),
        description=_SECTIONS_BY_FIELD["index"].description,
    )
    copy: PluginConfig = Field(  # type: ignore[assignment]
        default_factory=partial(_default_section, "copy"),
        description=_SECTIONS_BY_FIELD["copy"].description,
    )
    layout: PluginConfig = Field(
        default_factory=partial(_default_section, "layout"),
        description=_SECTIONS_BY_FIELD["layout"].description,
    )

    _sources: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("index", "copy", "layout", mode="before")
    @classmethod
    def _shorthand(cls, value: Any) -> Any:
        return _section_shorthand(value)

    @model_validator(mode="after")
    def _sections_are_plugin_models(self) -> KVTierConfig:
        for section in SECTIONS:
            if type(getattr(self, section.field)) is PluginConfig:
                raise ValueError(
                    f"{section.field} must be a registered plugin's config model; pass an "
                    "instance of it or build the config with kvtier.config.load_config"
                )
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # The validating subclass is built at run time, so pickle by value: the receiving
        # process validates again against its own plugins (vLLM's workers build their own).
        return (_restore_config, (self.model_dump(), dict(self._sources)))

    def source_of(self, path: str) -> str:
        """Return where the value at dotted ``path`` came from.

        Args:
            path: A dotted field path such as ``"cpu_bytes"`` or ``"copy.type"``.

        Returns:
            ``"explicit"``, ``"env KVTIER_..."``, ``"file <path>"`` or ``"default"``.
        """
        return self._sources.get(path, DEFAULT_SOURCE)

    def sources(self) -> dict[str, str]:
        """Return every leaf value's dotted path mapped to where it came from."""
        return {path: self.source_of(path) for path in _leaf_paths(self.model_dump())}

    def host_bytes_per_rank(self, world_size: int) -> int:
        """Return the host tier bytes of one rank.

        Args:
            world_size: Number of ranks (workers) the engine runs.

        Returns:
            ``cpu_bytes_per_rank`` when set, else ``cpu_bytes // world_size``.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        if self.cpu_bytes_per_rank is not None:
            return self.cpu_bytes_per_rank
        return self.cpu_bytes // world_size

    def host_slots(self, record_bytes: int, world_size: int = 1) -> int:
        """Return how many block records fit in one rank's host tier.

        Args:
            record_bytes: Bytes of one block across all layers (``KVLayout.record_bytes``).
            world_size: Number of ranks the host tier is split over.

        Returns:
            The slot count, at least 1.

        Raises:
            ConfigError: One rank's share is smaller than one block record; the
                line names ``cpu_bytes`` or ``cpu_bytes_per_rank`` and its source.
        """
        if record_bytes < 1:
            raise ValueError(f"record_bytes must be at least 1, got {record_bytes}")
        per_rank = self.host_bytes_per_rank(world_size)
        slots = per_rank // record_bytes
        if slots >= 1:
            return slots
        if self.cpu_bytes_per_rank is not None:
            field, value = "cpu_bytes_per_rank", self.cpu_bytes_per_rank
            message = (
                f"below one block record of {record_bytes} bytes; set it to at least {record_bytes}"
            )
        else:
            field, value = "cpu_bytes", self.cpu_bytes
            message = (
                f"{per_rank} bytes per rank over {world_size} rank(s) is below one block record "
                f"of {record_bytes} bytes; set it to at least {record_bytes * world_size}"
            )
        raise ConfigError([Problem(self.source_of(field), field, message, value)])

    def check_host_memory(
        self, world_size: int = 1, *, ranks: int = 1, available_bytes: int | None = None
    ) -> None:
        """Check, before anything is allocated, that host tiers fit in the memory available.

        Args:
            world_size: Number of ranks the host tier is split over.
            ranks: Ranks whose host tiers this machine is about to hold: 1 in a
                worker about to allocate its own, ``world_size`` to check a whole
                server ahead of time.
            available_bytes: Memory to check against; :func:`available_memory_bytes`
                if ``None`` (no check when that cannot be read either).

        Raises:
            ConfigError: The tiers need more; the line names ``cpu_bytes`` or
                ``cpu_bytes_per_rank``, its source, and both numbers.
        """
        per_rank = self.host_bytes_per_rank(world_size)
        if ranks < 1 or ranks > world_size:
            raise ValueError(f"ranks must be within 1..{world_size}, got {ranks}")
        available = available_memory_bytes() if available_bytes is None else available_bytes
        needed = per_rank * ranks
        if available is None or needed <= available:
            return
        field = "cpu_bytes" if self.cpu_bytes_per_rank is None else "cpu_bytes_per_rank"
        if ranks > 1:
            what = f"{ranks} ranks of {per_rank} bytes need {needed} bytes"
        elif world_size > 1:
            what = f"one rank of {world_size} needs {needed} bytes"
        else:
            what = f"the host tier needs {needed} bytes"
        message = (
            f"{what} ({_gib(needed)}), more than the {available} bytes ({_gib(available)}) of "
            f"memory available on this machine; lower {field}"
        )
        raise ConfigError([Problem(self.source_of(field), field, message, getattr(self, field))])


def _gib(count: int) -> str:
    return f"{count / GiB:.1f} GiB"


def available_memory_bytes(meminfo: str | os.PathLike[str] = MEMINFO) -> int | None:
    """Return the memory this machine can give new allocations without swapping, in bytes.

    Args:
        meminfo: The kernel's memory report to read ``MemAvailable`` from.

    Returns:
        ``MemAvailable`` from ``meminfo``; where that cannot be read, the
        machine's physical memory (``os.sysconf``); ``None`` when neither is known.
    """
    try:
        with open(meminfo, encoding="ascii") as report:
            for line in report:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _restore_config(values: dict[str, Any], sources: dict[str, str]) -> KVTierConfig:
    config = config_model().model_validate(values)
    config._sources = sources
    return config


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration."""

    source: str
    path: str
    message: str
    value: Any = None
    has_value: bool = True

    def __str__(self) -> str:
        got = _short_repr(self.value) if self.has_value else "nothing"
        return f"{self.source}: {self.path}: {self.message} (got {got})"


class ConfigError(ValueError):
    """The configuration is invalid; :attr:`lines` holds one formatted line per problem."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        header = f"invalid kvtier configuration: {count} problem{'s' if count != 1 else ''}"
        super().__init__("\n".join([header, *self.lines]))

    @property
    def lines(self) -> list[str]:
        """One ``<source>: <dotted.path>: <message> (got <value>)`` line per problem."""
        return [str(problem) for problem in self.problems]


class _ValueRepr(reprlib.Repr):
    """``repr`` in bounded time and size: a few items and levels of a container, cut strings."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxstring = self.maxlong = self.maxother = limit

    def repr_int(self, x: int, level: int) -> str:
        # Decimal conversion of a huge integer is quadratic, and refused past 4300 digits.
        if x.bit_length() > 4 * self.maxlong:
            return f"<a {x.bit_length()}-bit integer>"
        return super().repr_int(x, level)


_VALUE_CHARS = 80
_VALUE_REPR = _ValueRepr(_VALUE_CHARS)


def _short_repr(value: Any, limit: int = _VALUE_CHARS) -> str:
    text = _VALUE_REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _leaf_paths(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            paths.extend(_leaf_paths(value, f"{path}."))
        else:
            paths.append(path)
    return paths


def _no_implementation(section: Section) -> Callable[[Any], Any]:
    def reject(value: Any) -> Any:
        raise ValueError(f"no {_title(section)} is installed; install a plugin that provides one")

    return reject


def _title(section: Section) -> str:
    from kvtier.plugins import KIND_TITLES

    return KIND_TITLES[section.kind]


_MODELS: dict[int, tuple[Registry, type[KVTierConfig]]] = {}


def config_model(registry: Registry | None = None) -> type[KVTierConfig]:
    """Return the :class:`KVTierConfig` subclass that validates against ``registry``'s plugins.

    Each pluggable section becomes a discriminated union (on ``type``) of the
    config models registered for its kind; its default is the section's
    default implementation when that is registered, else the section is required.

    Args:
        registry: The plugins to validate against; the process's default registry if ``None``.

    Returns:
        A model class whose JSON schema includes every plugin's config model.
    """
    from kvtier.plugins import default_registry

    registry = registry or default_registry()
    cached = _MODELS.get(id(registry))
    if cached is not None and cached[0] is registry:
        return cached[1]
    fields: dict[str, Any] = {}
    for section in SECTIONS:
        registered = registry.of_kind(section.kind)
        models = tuple(reg.config_model for reg in registered.values())
        if models:
            annotation: Any = Annotated[Union[models], Field(discriminator="type")]  # noqa: UP007
        else:
            annotation = Annotated[PluginConfig, AfterValidator(_no_implementation(section))]
        if section.default in registered:
            default = Field(
                default_factory=registered[section.default].config_model,
                description=section.description,
            )
        else:
            default = Field(description=section.description)
        fields[section.field] = (annotation, default)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_COPY_SHADOWS, category=UserWarning)
        model: type[KVTierConfig] = create_model(
            "KVTierConfig",
            __base__=KVTierConfig,
            __doc__=KVTierConfig.__doc__,
            __module__=__name__,
            **fields,
        )
    # One model per registry, so configs validated against the same plugins compare equal.
    _MODELS[id(registry)] = (registry, model)
    return model


class _Layers:
    """Raw config values merged from several sources, remembering who set what."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}

    def apply(self, data: Mapping[str, Any], source: Callable[[str], str]) -> None:
        """Merge ``data`` over what is there; ``source(dotted_path)`` names who set each value."""
        self._merge(self.values, data, (), source)

    def _merge(
        self,
        target: dict[str, Any],
        data: Mapping[str, Any],
        path: tuple[str, ...],
        source: Callable[[str], str],
    ) -> None:
        for key, raw in data.items():
            key_path = (*path, str(key))
            dotted = ".".join(key_path)
            value = raw
            if not path and key in _SECTIONS_BY_FIELD:
                value = _section_shorthand(raw)
                current = target.get(key)
                if (
                    isinstance(value, Mapping)
                    and isinstance(current, Mapping)
                    and "type" in value
                    and value["type"] != current.get("type")
                ):
                    # Another implementation: the lower source's settings belong to the old one.
                    del target[key]
                    self._forget_below(dotted)
            self.sources[dotted] = source(dotted)
            if isinstance(value, Mapping):
                if not isinstance(target.get(key), dict):
                    target[key] = {}
                    self._forget_below(dotted)
                self._merge(target[key], value, key_path, source)
            else:
                target[key] = value
                self._forget_below(dotted)

    def _forget_below(self, dotted: str) -> None:
        prefix = f"{dotted}."
        for path in [path for path in self.sources if path.startswith(prefix)]:
            del self.sources[path]

    def source_of(self, loc: tuple[Any, ...]) -> str:
        """Who set the value at ``loc``, or at the nearest enclosing path someone set."""
        parts = [str(part) for part in loc]
        for end in range(len(parts), 0, -1):
            source = self.sources.get(".".join(parts[:end]))
            if source is not None:
                return source
        return DEFAULT_SOURCE


def _env_values(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], list[Problem]]:
    """Parse ``KVTIER_*`` variables into nested values, their variable names, and problems."""
    values: dict[str, Any] = {}
    names: dict[str, str] = {}
    problems: list[Problem] = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        raw = env[name]
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        dotted = ".".join(parts)
        if not all(re.fullmatch(r"[a-z][a-z0-9_]*", part) for part in parts):
            problems.append(
                Problem(
                    f"env {name}",
                    dotted or "(root)",
                    "not a config path; write KVTIER_<FIELD>, nesting sections with a double "
                    "underscore, e.g. KVTIER_CPU_BYTES or KVTIER_COPY__TYPE",
                    raw,
                )
            )
            continue
        value: Any = raw
        if raw.lstrip().startswith(("{", "[")):
            try:
                value = json.loads(raw)
            except RecursionError:
                problems.append(Problem(f"env {name}", dotted, _TOO_DEEP, raw))
                continue
            except ValueError as exc:
                problems.append(
                    Problem(f"env {name}", dotted, f"value looks like JSON but is not: {exc}", raw)
                )
                continue
            problem = _shape_problem(value, f"env {name}", dotted, depth=len(parts))
            if problem is not None:
                problems.append(problem)
                continue
        node = values
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = _section_shorthand(child)
            node = child
        node[parts[-1]] = value
        names[dotted] = name
    return values, names, problems


_TOO_DEEP = f"nested more than {MAX_CONFIG_DEPTH} levels deep"


def _shape_problem(data: Any, source: str, path: str, depth: int = 0) -> Problem | None:
    """A problem if ``data`` nests too deep or holds too many values, else ``None``.

    Walks without recursion and stops at the first limit crossed, so a cyclic
    value, or one sharing a few containers many times over, costs at most
    :data:`MAX_CONFIG_VALUES` steps.

    Args:
        data: A raw value from a config source.
        source: The source, for the problem's line.
        path: Where ``data`` sits in the config, for the problem's line.
        depth: How deep ``data`` itself sits.
    """
    pending: list[tuple[Any, int]] = [(data, depth)]
    count = 1
    while pending:
        value, level = pending.pop()
        if isinstance(value, Mapping):
            children: Any = value.values()
        elif isinstance(value, (list, tuple, set, frozenset)):
            children = value
        else:
            continue
        if level >= MAX_CONFIG_DEPTH:
            return Problem(source, path, _TOO_DEEP, data)
        count += len(children)
        if count > MAX_CONFIG_VALUES:
            return Problem(
                source,
                path,
                f"more than {MAX_CONFIG_VALUES} values; a config needs far fewer",
                data,
            )
        pending.extend((child, level + 1) for child in children)
    return None


class _ConfigYAMLLoader(yaml.SafeLoader):
    """YAML's safe loader without aliases: ``*name`` can expand a few bytes exponentially."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"found alias *{event.anchor}; kvtier does not accept YAML aliases, write the "
                "value out",
                event.start_mark,
            )
        return super().compose_node(parent, index)  # type: ignore[no-any-return]


def _file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is, or ``None`` for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _read_config_text(path: str | os.PathLike[str], source: str) -> str:
    """Read a config file's text: a regular file of at most ``MAX_CONFIG_FILE_BYTES``, UTF-8."""

    def problem(message: str) -> ConfigError:
        return ConfigError([Problem(source, CONFIG_FILE_KEY, message, str(path))])

    too_large = problem(f"larger than the {MAX_CONFIG_FILE_BYTES} bytes a config file may have")

    def check(mode: int, size: int) -> None:
        kind = _file_kind(mode)
        if kind is not None:
            raise problem(f"{kind}, not a regular file; name a YAML or TOML file")
        if size > MAX_CONFIG_FILE_BYTES:
            raise too_large

    try:
        # Look before opening: opening a device can have effects of its own. Then open without
        # blocking (a FIFO put in the file's place meanwhile would wait for a writer) and look
        # again at what was opened.
        info = os.stat(path)
        check(info.st_mode, info.st_size)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
        with os.fdopen(os.open(path, flags), "rb") as stream:
            info = os.fstat(stream.fileno())
            check(info.st_mode, info.st_size)
            data = stream.read(MAX_CONFIG_FILE_BYTES + 1)
    except FileNotFoundError:
        raise problem("no such file") from None
    except OSError as exc:
        raise problem(f"cannot read file: {exc}") from None
    if len(data) > MAX_CONFIG_FILE_BYTES:  # a file whose size the kernel does not report
        raise too_large
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise problem(
            f"not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start}"
        ) from None


def read_config_file(path: str | os.PathLike[str], source: str) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) config file.

    Args:
        path: The file to read.
        source: Where the file name came from, for error lines (e.g. ``"env KVTIER_CONFIG"``).

    Returns:
        The file's top-level mapping (empty for an empty YAML file).

    Raises:
        ConfigError: The file is missing, not a regular file, unreadable, larger
            than :data:`MAX_CONFIG_FILE_BYTES`, not UTF-8, of an unknown type, not
            parseable (YAML aliases included), nested deeper than
            :data:`MAX_CONFIG_DEPTH`, or not a mapping at the top level.
    """
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError(
            [
                Problem(
                    source,
                    CONFIG_FILE_KEY,
                    "unknown file type; use .yaml, .yml or .toml",
                    str(path),
                )
            ]
        )
    text = _read_config_text(path, source)
    file_source = f"file {path}"
    try:
        data = (
            tomllib.loads(text) if suffix == ".toml" else yaml.load(text, Loader=_ConfigYAMLLoader)
        )
    except RecursionError:
        raise ConfigError([Problem(file_source, "(file)", _TOO_DEEP, str(path))]) from None
    # ValueError: TOML's errors, and numbers or dates Python cannot hold (a 5000-digit integer).
    except (ValueError, yaml.YAMLError) as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(
            [
                Problem(
                    file_source,
                    "(file)",
                    f"cannot parse {suffix[1:].upper()}: {message}",
                    str(path),
                )
            ]
        ) from None
    if data is None:
        return {}
    problem = _shape_problem(data, file_source, "(file)")
    if problem is not None:
        raise ConfigError([problem])
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem(file_source, "(file)", "the top level must be a mapping of config keys", data)]
        )
    return data


def _problem_from_error(error: Mapping[str, Any], layers: _Layers, registry: Registry) -> Problem:
    loc = tuple(error["loc"])
    # A tagged union puts the tag into the location; users never write it there.
    if len(loc) >= 2 and loc[0] in _SECTIONS_BY_FIELD:
        given = layers.values.get(loc[0])
        if isinstance(given, Mapping) and loc[1] == given.get("type"):
            loc = (loc[0], *loc[2:])
    path = ".".join(str(part) for part in loc) or "(root)"
    source = layers.source_of(loc)
    kind = error["type"]
    message = error["msg"]
    value = error.get("input")
    section = _SECTIONS_BY_FIELD.get(str(loc[0])) if loc else None
    if kind == "union_tag_invalid" and section is not None:
        path = f"{section.field}.type"
        source = layers.source_of((section.field, "type"))
        message = f"unknown {_title(section)} type; installed: {_choices(registry, section)}"
        value = error["ctx"]["tag"]
    elif kind == "union_tag_not_found" and section is not None:
        message = (
            f"missing 'type'; installed {_title(section)} types: {_choices(registry, section)}"
        )
    elif kind == "extra_forbidden":
        allowed = _allowed_keys(registry, loc[:-1], layers.values)
        message = f"unknown key; valid keys here: {', '.join(allowed)}"
    elif kind == "missing":
        if section is not None and len(loc) == 1:
            message = (
                f"required: the default {_title(section)} {section.default!r} is not "
                f"installed; set {section.field}.type to one of: {_choices(registry, section)}"
            )
        return Problem(source, path, message, has_value=False)
    elif message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return Problem(source, path, message, value)


def _choices(registry: Registry, section: Section) -> str:
    return ", ".join(sorted(registry.of_kind(section.kind))) or "none"


def _allowed_keys(
    registry: Registry, parent: tuple[Any, ...], values: Mapping[str, Any]
) -> list[str]:
    if not parent:
        return sorted(KVTierConfig.model_fields)
    section = _SECTIONS_BY_FIELD.get(str(parent[0]))
    if len(parent) == 1 and section is not None:
        given = values.get(section.field)
        name = given.get("type", section.default) if isinstance(given, Mapping) else section.default
        registered = registry.of_kind(section.kind)
        if name in registered:
            return sorted(registered[name].config_model.model_fields)
    return ["(see kvtier config schema)"]


def load_config(
    explicit: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    registry: Registry | None = None,
    config_file: str | os.PathLike[str] | None = None,
) -> KVTierConfig:
    """Merge the config sources and validate them against the installed plugins.

    Sources, highest first: ``explicit``, ``KVTIER_*`` variables in ``env``,
    then the file named by ``config_file`` (this argument, else the
    ``config_file`` key of ``explicit``, else ``KVTIER_CONFIG``). When a higher
    source names a different ``type`` for a section, the lower sources'
    settings for that section are dropped.

    Args:
        explicit: Values given by the caller, e.g. vLLM's ``kv_connector_extra_config``.
        env: Environment variables; ``os.environ`` if ``None``.
        registry: Plugins to validate against; the process's default registry if ``None``.
        config_file: A YAML or TOML file, overriding any other way of naming one.

    Returns:
        The validated config; :meth:`KVTierConfig.source_of` tells where each value came from.

    Raises:
        ConfigError: Any source is invalid; one line per problem.
    """
    from kvtier.plugins import default_registry

    env = os.environ if env is None else env
    registry = registry or default_registry()
    problems: list[Problem] = []
    explicit_problem = _shape_problem(explicit, EXPLICIT_SOURCE, "(root)")
    if explicit_problem is not None:
        problems.append(explicit_problem)
        explicit = None
    explicit = dict(explicit or {})
    named_file = explicit.pop(CONFIG_FILE_KEY, None)
    layers = _Layers()

    if config_file is not None:
        file_name, file_source = config_file, "argument config_file"
    elif named_file is not None:
        file_name, file_source = named_file, EXPLICIT_SOURCE
    elif env.get(CONFIG_FILE_ENV):
        file_name, file_source = env[CONFIG_FILE_ENV], f"env {CONFIG_FILE_ENV}"
    else:
        file_name, file_source = None, ""
    if file_name is not None:
        if not isinstance(file_name, (str, os.PathLike)):
            problems.append(
                Problem(file_source, CONFIG_FILE_KEY, "expected a file path", file_name)
            )
        else:
            try:
                file_values = read_config_file(file_name, file_source)
                layers.apply(file_values, lambda dotted: f"file {file_name}")
            except ConfigError as exc:
                problems.extend(exc.problems)

    env_values, env_names, env_problems = _env_values(env)
    problems.extend(env_problems)
    layers.apply(env_values, lambda dotted: f"env {_env_name_for(dotted, env_names)}")
    layers.apply(explicit, lambda dotted: EXPLICIT_SOURCE)

    for section in SECTIONS:
        given = layers.values.get(section.field)
        if isinstance(given, dict) and "type" not in given:
            given["type"] = section.default
    model = config_model(registry)
    try:
        config = model.model_validate(layers.values)
    except ValidationError as exc:
        problems.extend(_problem_from_error(error, layers, registry) for error in exc.errors())
        raise ConfigError(problems) from None
    if problems:
        raise ConfigError(problems)
    config._sources = dict(layers.sources)
    return config


def _env_name_for(dotted: str, names: Mapping[str, str]) -> str:
    """The variable that set ``dotted`` or a value around it, else the first that set one below."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = names.get(".".join(parts[:end]))
        if name is not None:
            return name
    return min(name for path, name in names.items() if path.startswith(f"{dotted}."))
