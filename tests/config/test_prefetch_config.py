"""The prefetch section: its policies, its bounds, and the mistakes it refuses."""

from __future__ import annotations

import pytest
import yaml

from kvtier.config import ConfigError, load_config


def test_defaults_and_sources() -> None:
    assert load_config({}, env={}).prefetch.policy == "wait_complete"
    env = {"KVTIER_PREFETCH__POLICY": "timeout", "KVTIER_PREFETCH__TIMEOUT_S": "0.25"}
    prefetch = load_config({}, env=env).prefetch
    assert (prefetch.policy, prefetch.timeout_s) == ("timeout", 0.25)


def test_a_bare_yaml_off_is_off() -> None:
    given = yaml.safe_load("prefetch: {policy: off}")
    assert load_config(given, env={}).prefetch.policy == "off"


@pytest.mark.parametrize(
    ("prefetch", "line"),
    [
        ({"policy": "eager"}, "explicit: prefetch.policy: Input should be 'off', 'best_effort'"),
        ({"timeout_s": 2}, "explicit: prefetch: timeout_s applies only to policy 'timeout'"),
        ({"policy": "timeout", "timeout_s": 0}, "explicit: prefetch.timeout_s: Input should be"),
        ({"max_host_share": 1.5}, "explicit: prefetch.max_host_share: Input should be less"),
        ({"share": 0.5}, "explicit: prefetch.share: unknown key; valid keys here: max_host_share"),
    ],
)
def test_mistakes_are_one_line_each(prefetch: dict[str, object], line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"prefetch": prefetch}, env={})
    (problem,) = str(caught.value).splitlines()[1:]
    assert problem.startswith(line), problem
