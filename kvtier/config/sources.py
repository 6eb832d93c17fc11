"""Where config values come from: explicit values, ``KVTIER_*`` variables and files, merged.

:class:`Layers` merges the sources lowest first and remembers, for every dotted
path, which source set it. Reading is bounded, because a config may come from
anywhere: a file must be a regular file of at most :data:`MAX_CONFIG_FILE_BYTES`,
YAML aliases are refused, every source may nest at most :data:`MAX_CONFIG_DEPTH`
levels and hold at most :data:`MAX_CONFIG_VALUES` values, and numbers must be
finite.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from kvtier.config.errors import ConfigError, Problem
from kvtier.config.model import DEFAULT_SOURCE, SECTIONS_BY_FIELD, section_shorthand

ENV_PREFIX = "KVTIER_"
CONFIG_FILE_ENV = "KVTIER_CONFIG"
CONFIG_FILE_KEY = "config_file"
RESERVED_ENV: frozenset[str] = frozenset({CONFIG_FILE_ENV, "KVTIER_LOAD_PLUGINS"})
"""``KVTIER_*`` variables that are not configuration values."""
EXPLICIT_SOURCE = "explicit"
MAX_CONFIG_FILE_BYTES = 1 << 20
"""Largest config file kvtier reads; a real one is a few hundred bytes."""
MAX_CONFIG_DEPTH = 32
"""Deepest nesting of mappings and lists in one config source."""
MAX_CONFIG_VALUES = 10_000
"""Most values (mappings, lists and scalars) one config source may hold."""


class Layers:
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
            if not path and key in SECTIONS_BY_FIELD:
                value = section_shorthand(raw)
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


def read_env(env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str], list[Problem]]:
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
            problem = shape_problem(value, f"env {name}", dotted, depth=len(parts))
            if problem is not None:
                problems.append(problem)
                continue
        node = values
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                child = node[part] = section_shorthand(child)
            node = child
        node[parts[-1]] = value
        names[dotted] = name
    return values, names, problems


_TOO_DEEP = f"nested more than {MAX_CONFIG_DEPTH} levels deep"


def shape_problem(data: Any, source: str, path: str, depth: int = 0) -> Problem | None:
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


def file_kind(mode: int) -> str | None:
    """What a file that is not a regular file is, or ``None`` for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _read_config_text(path: str | os.PathLike[str], source: str) -> str:
    """Read a config file's text: a regular file of at most ``MAX_CONFIG_FILE_BYTES``, UTF-8."""

    def problem(message: str) -> ConfigError:
        return ConfigError([Problem(source, CONFIG_FILE_KEY, message, str(path))])

    too_large = problem(f"larger than the {MAX_CONFIG_FILE_BYTES} bytes a config file may have")

    def check(mode: int, size: int) -> None:
        kind = file_kind(mode)
        if kind is not None:
            raise problem(f"{kind}, not a regular file; name a YAML, TOML or JSON file")
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


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_ConfigYAMLLoader)


_PARSERS: dict[str, Callable[[str], Any]] = {
    ".yaml": _load_yaml,
    ".yml": _load_yaml,
    ".toml": tomllib.loads,
    ".json": json.loads,
}
"""How each config file type is parsed, by file name suffix."""


def read_config_file(path: str | os.PathLike[str], source: str) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``) config file.

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
    if suffix not in _PARSERS:
        raise ConfigError(
            [
                Problem(
                    source,
                    CONFIG_FILE_KEY,
                    "unknown file type; use .yaml, .yml, .toml or .json",
                    str(path),
                )
            ]
        )
    text = _read_config_text(path, source)
    file_source = f"file {path}"
    try:
        data = _PARSERS[suffix](text)
    except RecursionError:
        raise ConfigError([Problem(file_source, "(file)", _TOO_DEEP, str(path))]) from None
    # ValueError: TOML's and JSON's errors, and numbers or dates Python cannot hold (a
    # 5000-digit integer).
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
    problem = shape_problem(data, file_source, "(file)")
    if problem is not None:
        raise ConfigError([problem])
    if not isinstance(data, dict):
        raise ConfigError(
            [Problem(file_source, "(file)", "the top level must be a mapping of config keys", data)]
        )
    return data


def env_name_for(dotted: str, names: Mapping[str, str]) -> str:
    """The variable that set ``dotted`` or a value around it, else the first that set one below."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        name = names.get(".".join(parts[:end]))
        if name is not None:
            return name
    return min(name for path, name in names.items() if path.startswith(f"{dotted}."))
