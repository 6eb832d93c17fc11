"""Configuration: the settings kvtier checks once at start-up, and where each value came from.

The package is split by concern; every public name is importable from
``kvtier.config`` itself:

- :mod:`kvtier.config.model`: :class:`KVTierConfig` and its sections as plain
  data, and the host tier's capacity rules (its bytes per rank, its slot count,
  the memory check); building one loads no plugin.
- :mod:`kvtier.config.schema`: :func:`config_model`, the validating model for
  a registry's plugins, and :func:`config_json_schema`, the JSON Schema
  ``kvtier config schema`` prints.
- :mod:`kvtier.config.sources`: explicit values, ``KVTIER_*`` variables and
  files, merged with their provenance, and the limits on reading them.
- :mod:`kvtier.config.load`: :func:`load_config`, which merges the sources and
  validates them against a registry.
- :mod:`kvtier.config.errors`: :class:`ConfigError` and its one-line problems.
- :mod:`kvtier.config.units`: byte sizes read and written, importing nothing of kvtier.
- :mod:`kvtier.config.bounds`: the longest duration, the largest queue and tier
  list, and checked paths, shared by every config model.
"""

from kvtier.config.bounds import MAX_DURATION_S, MAX_QUEUE_DEPTH, MAX_TIERS, LocalPath
from kvtier.config.errors import ConfigError, Problem
from kvtier.config.load import load_config
from kvtier.config.model import (
    DEFAULT_CLOSE_TIMEOUT_S,
    DEFAULT_COPY_DEADLINE_S,
    DEFAULT_CPU_BYTES,
    DEFAULT_REPORT_DEADLINE_S,
    DEFAULT_SOURCE,
    SECTIONS,
    KVTierConfig,
    RootSettings,
    Section,
    SectionConfig,
    available_memory_bytes,
)
from kvtier.config.schema import config_json_schema, config_model
from kvtier.config.sources import (
    CONFIG_FILE_ENV,
    CONFIG_FILE_KEY,
    ENV_PREFIX,
    EXPLICIT_SOURCE,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_FILE_BYTES,
    MAX_CONFIG_VALUES,
    RESERVED_ENV,
    read_config_file,
)
from kvtier.config.units import ByteCount, GiB, format_bytes, parse_bytes
from kvtier.models import KVTierModel, PluginConfig

__all__ = [
    "CONFIG_FILE_ENV",
    "CONFIG_FILE_KEY",
    "DEFAULT_CLOSE_TIMEOUT_S",
    "DEFAULT_COPY_DEADLINE_S",
    "DEFAULT_CPU_BYTES",
    "DEFAULT_REPORT_DEADLINE_S",
    "DEFAULT_SOURCE",
    "ENV_PREFIX",
    "EXPLICIT_SOURCE",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_FILE_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_DURATION_S",
    "MAX_QUEUE_DEPTH",
    "MAX_TIERS",
    "RESERVED_ENV",
    "SECTIONS",
    "ByteCount",
    "ConfigError",
    "GiB",
    "KVTierConfig",
    "KVTierModel",
    "LocalPath",
    "PluginConfig",
    "Problem",
    "RootSettings",
    "Section",
    "SectionConfig",
    "available_memory_bytes",
    "config_json_schema",
    "config_model",
    "format_bytes",
    "load_config",
    "parse_bytes",
    "read_config_file",
]
