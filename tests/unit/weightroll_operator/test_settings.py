"""OperatorConfig.from_env: every field from ``WEIGHTROLL_<FIELD>``, booleans parsed as words;
every bound (the fields' constraints) refused and accepted, one line naming the variable or flag."""

from __future__ import annotations

import math

import pytest
from annotated_types import Ge, Gt, Le
from weightroll_operator.settings import OperatorConfig

FIELDS = OperatorConfig.model_fields


def _bound(name: str, kind: type) -> float | None:
    return next(
        (getattr(m, kind.__name__.lower()) for m in FIELDS[name].metadata if isinstance(m, kind)),
        None,
    )


PORTS = [name for name in FIELDS if _bound(name, Le) == 65535]
#: (field, least value, whether the least value itself is allowed) of every lower-bounded field.
LOWER_BOUNDS = [
    (
        name,
        _bound(name, Gt) if _bound(name, Gt) is not None else _bound(name, Ge),
        _bound(name, Gt) is None,
    )
    for name in FIELDS
    if (_bound(name, Gt) is not None or _bound(name, Ge) is not None) and name not in PORTS
]
SWITCHES = [name for name, field in FIELDS.items() if field.annotation is bool]
NUMBERS = [name for name, field in FIELDS.items() if field.annotation in (int, float)]


def _var(name: str) -> str:
    return f"WEIGHTROLL_{name.upper()}"


def _refusal(env: dict[str, str], **flags: object) -> str:
    with pytest.raises(ValueError) as refused:
        OperatorConfig.from_env(env, **flags)
    message = str(refused.value)
    assert "\n" not in message
    return message


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
    with pytest.raises(ValueError, match="--interval=0: must be a number greater than 0"):
        OperatorConfig.from_env({"WEIGHTROLL_INTERVAL": "5"}, interval=0)


def test_the_generated_cases_cover_every_bounded_field() -> None:
    """The tables below come from the fields' constraints; they must find what is there."""
    assert len(LOWER_BOUNDS) == 11 and ("burst", 1, True) in LOWER_BOUNDS
    assert ("interval", 0, False) in LOWER_BOUNDS
    assert PORTS == ["metrics_port", "health_port", "webhook_port"]
    assert SWITCHES == ["leader_elect", "admit_unmanaged_pods"]


@pytest.mark.parametrize(("name", "least", "inclusive"), LOWER_BOUNDS)
def test_every_lower_bound_is_enforced_for_variable_and_flag(
    name: str, least: float, inclusive: bool
) -> None:
    var, flag = _var(name), "--" + name.replace("_", "-")
    words = "at least" if inclusive else "greater than"
    at_bound = {_var(name): f"{least:g}"}
    if inclusive:
        assert getattr(OperatorConfig.from_env(at_bound), name) == least
    else:
        assert f"{var}='{least:g}': must be " in _refusal(at_bound)
    below = {var: f"{least - 1:g}"}
    assert _refusal(below).startswith(f"{var}='{least - 1:g}': must be ")
    assert f"{words} {least:g}" in _refusal(below)
    assert _refusal({}, **{name: least - 1}).startswith(f"{flag}={least - 1!r}: must be ")
    assert getattr(OperatorConfig.from_env({var: f"{least + 1:g}"}), name) == least + 1


@pytest.mark.parametrize("name", NUMBERS)
@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "", "many", "1e400"])
def test_not_a_finite_number_is_refused_naming_the_variable(name: str, raw: str) -> None:
    assert _refusal({_var(name): raw}).startswith(f"{_var(name)}={raw!r}: must be ")


@pytest.mark.parametrize("name", NUMBERS)
def test_nan_and_infinity_flags_are_refused_naming_the_flag(name: str) -> None:
    for value in (math.nan, math.inf, -math.inf):
        assert _refusal({}, **{name: value}).startswith(f"--{name.replace('_', '-')}=")


@pytest.mark.parametrize("name", PORTS)
def test_every_port_is_a_port_or_zero(name: str) -> None:
    for raw, value in (("0", 0), ("1", 1), ("65535", 65535)):
        assert getattr(OperatorConfig.from_env({_var(name): raw}), name) == value
    for raw in ("-1", "65536", "http", "80.5"):
        assert "a port from 1 to 65535, or 0 to disable it" in _refusal({_var(name): raw})


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize(
    ("raw", "expected"),
    [(w, True) for w in ("true", "YES", "on", "1", " True ")]
    + [(w, False) for w in ("false", "No", "OFF", "0", "\tfalse\n")],
)
def test_every_switch_accepts_its_words(name: str, raw: str, expected: bool) -> None:
    assert getattr(OperatorConfig.from_env({_var(name): raw}), name) is expected


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("raw", ["", " ", "maybe", "2", "-1", "enable", "none", "null", "yess"])
def test_every_switch_refuses_other_words(name: str, raw: str) -> None:
    message = _refusal({_var(name): raw})
    assert message == f"{_var(name)}={raw!r}: must be one of true/false, yes/no, on/off, 1/0"


def test_several_refusals_are_one_line_naming_each() -> None:
    message = _refusal({"WEIGHTROLL_BURST": "0", "WEIGHTROLL_LEADER_ELECT": "maybe"}, interval=-1)
    for named in ("WEIGHTROLL_BURST='0'", "WEIGHTROLL_LEADER_ELECT='maybe'", "--interval=-1"):
        assert named in message


def test_only_the_given_mapping_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIGHTROLL_BURST", "0")
    assert OperatorConfig.from_env({}).burst == 250
    assert OperatorConfig().burst == 250
    with pytest.raises(ValueError, match="WEIGHTROLL_BURST='0'"):
        OperatorConfig.from_env()
    monkeypatch.setenv("WEIGHTROLL_BURST", "7")
    assert OperatorConfig.from_env().burst == 7


def test_an_unknown_flag_is_refused() -> None:
    with pytest.raises(ValueError, match="--bursts=3"):
        OperatorConfig.from_env({}, bursts=3)


def test_the_config_is_frozen() -> None:
    config = OperatorConfig()
    with pytest.raises(ValueError, match="frozen"):
        config.burst = 3  # type: ignore[misc]
    assert hash(config) == hash(OperatorConfig())
