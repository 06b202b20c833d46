"""OperatorConfig.from_env: every field from ``WEIGHTROLL_<FIELD>``, booleans parsed as words."""

from __future__ import annotations

import pytest
from weightroll_operator.settings import OperatorConfig


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("false", False),
        ("False", False),
        ("0", False),
        ("no", False),
        ("off", False),
        ("true", True),
        ("TRUE", True),
        ("1", True),
        ("yes", True),
        (" on ", True),
    ],
)
def test_bool_from_env(raw: str, expected: bool) -> None:
    config = OperatorConfig.from_env({"WEIGHTROLL_ADMIT_UNMANAGED_PODS": raw})
    assert config.admit_unmanaged_pods is expected


@pytest.mark.parametrize("raw", ["", "maybe", "2"])
def test_bool_from_env_refuses_other_words(raw: str) -> None:
    with pytest.raises(ValueError, match="WEIGHTROLL_ADMIT_UNMANAGED_PODS"):
        OperatorConfig.from_env({"WEIGHTROLL_ADMIT_UNMANAGED_PODS": raw})


def test_defaults_types_and_overrides() -> None:
    assert OperatorConfig.from_env({}) == OperatorConfig()
    assert OperatorConfig().admit_unmanaged_pods is True
    config = OperatorConfig.from_env(
        {
            "WEIGHTROLL_INTERVAL": "2.5",
            "WEIGHTROLL_CONCURRENCY": "4",
            "WEIGHTROLL_METRICS_ADDR": "127.0.0.1",
            "WEIGHTROLL_HEALTH_PORT": "9",
        },
        interval=1.0,
        health_port=None,  # None: not given on the command line
    )
    assert (config.interval, config.concurrency, config.metrics_addr) == (1.0, 4, "127.0.0.1")
    assert config.health_port == 9
    with pytest.raises(ValueError, match="WEIGHTROLL_CONCURRENCY='many'"):
        OperatorConfig.from_env({"WEIGHTROLL_CONCURRENCY": "many"})


@pytest.mark.parametrize(
    ("var", "raw", "accepts"),
    [
        ("WEIGHTROLL_BURST", "0", "at least 1"),
        ("WEIGHTROLL_BURST", "-5", "at least 1"),
        ("WEIGHTROLL_CONCURRENCY", "0", "at least 1"),
        ("WEIGHTROLL_INTERVAL", "0", "greater than 0"),
        ("WEIGHTROLL_POLL_INTERVAL", "-0.5", "greater than 0"),
        ("WEIGHTROLL_INTERVAL", "nan", "greater than 0"),
        ("WEIGHTROLL_STATE_TTL", "NaN", "at least 0"),
        ("WEIGHTROLL_AGENT_TIMEOUT", "0", "greater than 0"),
        ("WEIGHTROLL_LEASE_SECONDS", "0", "greater than 0"),
        ("WEIGHTROLL_GC_FULL_INTERVAL", "-1", "at least 0"),
        ("WEIGHTROLL_STATE_TTL", "-1", "at least 0"),
        ("WEIGHTROLL_WATCH_SERVER_TIMEOUT", "0", "at least 1"),
        ("WEIGHTROLL_METRICS_PORT", "70000", "0 to disable"),
        ("WEIGHTROLL_HEALTH_PORT", "-1", "0 to disable"),
        ("WEIGHTROLL_POSTING_LEVEL", "LOUD", "WARNING"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_variable(
    var: str, raw: str, accepts: str
) -> None:
    with pytest.raises(ValueError, match=f"{var}=.*{accepts}"):
        OperatorConfig.from_env({var: raw})


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WEIGHTROLL_BURST": "1"}, ("burst", 1)),
        ({"WEIGHTROLL_GC_FULL_INTERVAL": "0"}, ("gc_full_interval", 0.0)),
        ({"WEIGHTROLL_STATE_TTL": "0"}, ("state_ttl", 0.0)),
        ({"WEIGHTROLL_METRICS_PORT": "0"}, ("metrics_port", 0)),
        ({"WEIGHTROLL_POSTING_LEVEL": "ERROR"}, ("posting_level", "ERROR")),
    ],
)
def test_values_at_their_bounds_are_accepted(
    env: dict[str, str], expected: tuple[str, object]
) -> None:
    name, value = expected
    assert getattr(OperatorConfig.from_env(env), name) == value


def test_an_out_of_range_flag_is_named_as_the_flag() -> None:
    with pytest.raises(ValueError, match="--interval=0: must be greater than 0"):
        OperatorConfig.from_env({"WEIGHTROLL_INTERVAL": "5"}, interval=0)
