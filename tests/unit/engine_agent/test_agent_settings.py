"""``weightroll-agent``'s settings (``AgentSettings``, pydantic-settings): every bounded field,
generated from its constraints, refused or accepted as a flag and as its ``WEIGHTROLL_AGENT_*``
variable, with one line naming whichever was given; a flag wins over its variable."""

from __future__ import annotations

import pytest
from annotated_types import Ge, Gt, Le

from engine_agent.sidecar.main import AgentSettings, _parser, parse_args

FIELDS = AgentSettings.model_fields
SECONDS = [name for name, field in FIELDS.items() if field.annotation is float]
WHOLE = [
    name
    for name, field in FIELDS.items()
    if field.annotation is int and not any(isinstance(m, Le) for m in field.metadata)
]
PORTS = [name for name, field in FIELDS.items() if any(isinstance(m, Le) for m in field.metadata)]


def _var(name: str) -> str:
    return f"WEIGHTROLL_AGENT_{name.upper()}"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in FIELDS:
        monkeypatch.delenv(_var(name), raising=False)


def _refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse_args(argv)
    assert stopped.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("weightroll-agent: error: ")
    return last.removeprefix("weightroll-agent: error: ")


def test_the_generated_cases_cover_every_bounded_field() -> None:
    assert len(SECONDS) == 9 and "push_idle_timeout" in SECONDS
    assert WHOLE == ["max_connections"]
    assert PORTS == ["port"]
    for name in SECONDS:
        assert [m.gt for m in FIELDS[name].metadata if isinstance(m, Gt)] == [0]
    assert [m.ge for m in FIELDS["max_connections"].metadata if isinstance(m, Ge)] == [1]


def test_every_field_is_a_flag_with_help_naming_its_variable() -> None:
    helps = {a.option_strings[0]: a.help for a in _parser()._actions if a.option_strings}
    for name in FIELDS:
        assert f"[{name.upper()}]" in (helps[_flag(name)] or "")


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("raw", ["0", "-5", "nan", "NaN", "inf", "-inf", "1e400", "soon"])
def test_every_timeout_refuses_what_is_not_seconds_above_zero(
    name: str,
    raw: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    accepts = "must be a finite number of seconds above 0"
    assert _refusal(capsys, [f"{_flag(name)}={raw}"]).startswith(
        f"{_flag(name)}={raw!r}: {accepts}"
    )
    monkeypatch.setenv(_var(name), raw)
    assert _refusal(capsys, []).startswith(f"{_var(name)}={raw!r}: {accepts}")


@pytest.mark.parametrize("name", SECONDS)
def test_every_timeout_accepts_seconds_and_the_flag_wins(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert getattr(parse_args([]), name) == FIELDS[name].default
    monkeypatch.setenv(_var(name), "0.25")
    assert getattr(parse_args([]), name) == 0.25
    assert getattr(parse_args([_flag(name), "7"]), name) == 7.0
    monkeypatch.setenv(_var(name), "")  # empty: unset
    assert getattr(parse_args([]), name) == FIELDS[name].default


@pytest.mark.parametrize(
    ("name", "good", "bad"),
    [
        ("max_connections", ["1", "4096"], ["0", "-1", "1.5", "many", "nan"]),
        ("port", ["1", "8470", "65535"], ["0", "-1", "65536", "http", "nan"]),
    ],
)
def test_whole_numbers_and_the_port(
    name: str,
    good: list[str],
    bad: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    accepts = (
        "must be a TCP port (1-65535)" if name == "port" else "must be a whole number at least 1"
    )
    for raw in good:
        assert getattr(parse_args([_flag(name), raw]), name) == int(raw)
    for raw in bad:
        assert _refusal(capsys, [f"{_flag(name)}={raw}"]).startswith(
            f"{_flag(name)}={raw!r}: {accepts}"
        )
        monkeypatch.setenv(_var(name), raw)
        assert _refusal(capsys, []).startswith(f"{_var(name)}={raw!r}: {accepts}")
        monkeypatch.delenv(_var(name))


def test_several_refusals_are_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WEIGHTROLL_AGENT_PORT", "http")
    message = _refusal(capsys, ["--load-timeout", "0"])
    assert "WEIGHTROLL_AGENT_PORT='http'" in message and "--load-timeout='0'" in message


def test_host_falls_back_to_the_pod_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.1.2.3")
    assert parse_args([]).host == "10.1.2.3"
    monkeypatch.setenv("WEIGHTROLL_AGENT_HOST", "10.9.9.9")
    assert parse_args([]).host == "10.9.9.9"
    assert parse_args(["--host", "10.0.0.1"]).host == "10.0.0.1"
    monkeypatch.delenv("POD_IP")
    monkeypatch.delenv("WEIGHTROLL_AGENT_HOST")
    assert parse_args([]).host is None
