"""kvtier's records in vLLM's log stream, the start-up line, and config errors logged once."""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm033

from kvtier.config import ConfigError, load_config  # noqa: E402
from kvtier.integrations.vllm.connector import ConfigRefused, connector_config  # noqa: E402
from kvtier.integrations.vllm.logs import join_vllm_logging, startup_summary  # noqa: E402


@pytest.fixture
def kvtier_logger() -> Iterator[logging.Logger]:
    """The ``kvtier`` logger, restored afterwards: joining vLLM's logging changes it."""
    logger = logging.getLogger("kvtier")
    saved = (list(logger.handlers), logger.level)
    logger.handlers.clear()
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])


@pytest.fixture
def vllm_stream(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """A handler on the ``vllm`` logger, as vLLM configures one at INFO when it starts."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("(vllm) %(levelname)s [%(filename)s] %(message)s"))
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "handlers", [handler])
    monkeypatch.setattr(vllm_logger, "level", logging.INFO)
    return stream


def test_kvtier_records_go_to_vllms_handlers_at_vllms_level(
    kvtier_logger: logging.Logger, vllm_stream: io.StringIO
) -> None:
    assert join_vllm_logging()
    assert join_vllm_logging(), "joining twice must be harmless"
    logging.getLogger("kvtier.integrations.vllm.scheduler").info("kvtier scheduler: hello")
    logging.getLogger("kvtier.offload.worker").debug("not at vLLM's level")
    assert vllm_stream.getvalue() == "(vllm) INFO [test_vllm_logs.py] kvtier scheduler: hello\n"


def test_nothing_changes_without_vllms_handlers(
    kvtier_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger("vllm"), "handlers", [])
    assert not join_vllm_logging()
    assert kvtier_logger.handlers == []


def test_handlers_someone_gave_kvtier_are_kept(
    kvtier_logger: logging.Logger, vllm_stream: io.StringIO
) -> None:
    own = logging.NullHandler()
    kvtier_logger.addHandler(own)
    assert not join_vllm_logging()
    assert kvtier_logger.handlers == [own]


def test_start_up_line_says_sizes_in_units_and_where_values_came_from() -> None:
    config = load_config({"cpu_bytes": "64MiB", "copy": "torch"}, env={"KVTIER_STORE_MODE": "lazy"})
    line = startup_summary(config, role="worker", record_bytes=32768, world_size=2)
    assert line.startswith(
        "kvtier worker: lazy store mode, host tier 32.0MiB per rank (1024 slots of 32.0KiB, "
        "world size 2), policy prefix_arc, copy torch, layout auto; set: "
    )
    assert "cpu_bytes=64.0MiB (explicit)" in line
    assert "store_mode=lazy (env KVTIER_STORE_MODE)" in line
    assert "copy.type=torch (explicit)" in line
    assert "index.type" not in line, "defaults are not listed"
    default = load_config({}, env={})
    assert startup_summary(default, role="scheduler", record_bytes=1024, world_size=1).endswith(
        "; set: nothing (all defaults)"
    )


def test_invalid_extra_config_is_logged_once_and_not_repeated_in_the_error(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [name for name in os.environ if name.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"store_mode": "sometimes", "cpu_bytes": 0}
        )
    )
    with caplog.at_level(logging.ERROR, logger="kvtier"), pytest.raises(ConfigRefused) as raised:
        connector_config(vllm_config)  # type: ignore[arg-type]
    assert isinstance(raised.value, ConfigError)
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 2 == len(raised.value.lines)
    assert all(message.startswith("kv_connector_extra_config: explicit: ") for message in logged)
    message = str(raised.value)
    assert message.startswith("invalid kvtier configuration: 2 problems, logged above")
    assert "store_mode" not in message and "cpu_bytes" not in message


def test_tier_settings_validate_refuses_are_refused_before_an_engine_starts(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [name for name in os.environ if name.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    extra = {
        "tiers": [
            {"type": "redis", "url": "redis://:hunter2@cache:99999/0", "timeout_s": 1e10},
            {"type": "disk", "path": "", "capacity_bytes": "1GiB", "get_deadline_s": 1e10},
        ]
    }
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra)
    )
    with caplog.at_level(logging.ERROR, logger="kvtier"), pytest.raises(ConfigRefused) as raised:
        connector_config(vllm_config)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as validated:
        load_config(extra, env={})
    assert raised.value.lines == validated.value.lines
    assert [line.split(": ")[1] for line in raised.value.lines] == [
        "tiers[0].url",
        "tiers[0].timeout_s",
        "tiers[1].path",
        "tiers[1].get_deadline_s",
    ]
    assert "hunter2" not in caplog.text
