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
