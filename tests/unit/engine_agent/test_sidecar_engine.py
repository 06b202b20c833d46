"""Unit tests of the sidecar's vLLM client helpers, command line and persisted store."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_agent.protocol import SourceSpec, UpdatePhase, UpdateRequest
from engine_agent.sidecar.app import TokenFile
from engine_agent.sidecar.engine import VllmClient, parse_gauge, require_loopback
from engine_agent.sidecar.main import main as agent_main
from engine_agent.sidecar.state import MAX_RECORDS, STATE_FILE, Store, UpdateRecord


def test_non_loopback_vllm_urls_are_refused() -> None:
    for url in ("http://10.0.0.5:8000", "http://vllm.default.svc:8000", "https://127.0.0.1:8000"):
        with pytest.raises(ValueError):
            require_loopback(url)
    for url in ("http://127.0.0.1:8000/", "http://localhost:8000", "http://[::1]:8000"):
        assert not require_loopback(url).endswith("/")
    with pytest.raises(ValueError, match="loopback"):
        VllmClient("http://192.168.1.10:8000")


def test_agent_refuses_to_start_without_token_or_with_remote_vllm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    assert agent_main(["--vllm-url", "http://127.0.0.1:1"]) == 2
    assert "--token-file" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("")
    assert agent_main(["--token-file", str(empty)]) == 2
    assert "empty" in capsys.readouterr().err
    assert agent_main(["--token-file", str(tmp_path / "absent")]) == 2
    assert agent_main(["--token-file", str(token_file), "--vllm-url", "http://10.1.2.3:80"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_parse_gauge_sums_samples_and_ignores_longer_names() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_running_total{engine="0"} 99.0\n'
        "vllm:num_requests_waiting 7\n"
    )
    assert parse_gauge(text, "vllm:num_requests_running") == 4.0
    assert parse_gauge(text, "vllm:num_requests_waiting") == 7.0
    assert parse_gauge(text, "vllm:absent") is None


def test_token_file_strips_whitespace_and_compares_exactly(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("abc\n")
    tokens = TokenFile(path)
    assert tokens.matches(b"abc")
    assert not tokens.matches(b"abcd")
    assert not tokens.matches(b"")
    path.unlink()
    assert tokens.matches(b"abc"), "a vanished file keeps the last good token"


def _record(update_id: str, phase: UpdatePhase) -> UpdateRecord:
    request = UpdateRequest(id=update_id, version="v1", source=SourceSpec(uri="/ckpt"))
    return UpdateRecord(request=request, phase=phase, timings={"drain": 0.5})


def test_store_round_trips_through_the_state_dir(tmp_path: Path) -> None:
    store = Store(tmp_path)
    store.add(_record("u-1", UpdatePhase.COMMITTED))
    store.add(_record("u-2", UpdatePhase.LOADING))
    store.active_id = "u-2"
    store.memory.expected_version = "v1"
    store.memory.source = SourceSpec(uri="file:///ckpt/v1")
    store.memory.hold = "update_incomplete: update u-2 started"
    store.save()
    assert (tmp_path / STATE_FILE).exists()

    again = Store(tmp_path)
    assert again.load()
    assert again.active_id == "u-2"
    assert again.records["u-2"].phase is UpdatePhase.LOADING
    assert again.records["u-1"].to_status() == store.records["u-1"].to_status()
    assert again.memory == store.memory


def test_store_ignores_corrupt_state_and_bounds_history(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{broken")
    assert not Store(tmp_path).load()
    assert not Store(None).load()
    store = Store(None)
    for index in range(MAX_RECORDS + 10):
        store.add(_record(f"u-{index}", UpdatePhase.COMMITTED))
    assert len(store.records) == MAX_RECORDS
    assert "u-0" not in store.records


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--push-idle-timeout", "0"], {}, "--push-idle-timeout"),
        (["--load-timeout", "-5"], {}, "--load-timeout"),
        (["--watch-interval", "nan"], {}, "--watch-interval"),
        (["--begin-timeout", "inf"], {}, "--begin-timeout"),
        (["--finish-timeout", "soon"], {}, "--finish-timeout"),
        ([], {"WEIGHTROLL_AGENT_CONTROL_TIMEOUT": "0"}, "WEIGHTROLL_AGENT_CONTROL_TIMEOUT"),
        ([], {"WEIGHTROLL_AGENT_PUSH_IDLE_TIMEOUT": "x"}, "WEIGHTROLL_AGENT_PUSH_IDLE_TIMEOUT"),
        (["--port", "0"], {}, "--port"),
        ([], {"WEIGHTROLL_AGENT_PORT": "http"}, "WEIGHTROLL_AGENT_PORT"),
    ],
)
def test_bad_timeouts_and_ports_are_refused_at_start_naming_the_setting(
    argv: list[str],
    env: dict[str, str],
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A zero or negative timeout would end every call (or every trainer push) at once; the
    agent refuses to start instead, with exit 2 and a message naming the flag or variable."""
    from engine_agent.sidecar.main import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        main(["--token-file", "/nonexistent", *argv])
    assert stopped.value.code == 2
    assert named in capsys.readouterr().err


def test_flags_default_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from engine_agent.sidecar.main import build_config, parse_args

    monkeypatch.setenv("WEIGHTROLL_AGENT_VLLM_URL", "http://127.0.0.1:18000")
    monkeypatch.setenv("WEIGHTROLL_AGENT_LOAD_TIMEOUT", "42")
    monkeypatch.setenv("WEIGHTROLL_AGENT_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("WEIGHTROLL_AGENT_INITIAL_SOURCE", "file:///models/a")
    config = build_config(parse_args(["--finish-timeout", "7"]))
    assert config.vllm_url == "http://127.0.0.1:18000"
    assert config.load_timeout == 42.0
    assert config.finish_timeout == 7.0
    assert config.state_dir == tmp_path
    assert config.initial_source is not None and config.initial_source.path == "/models/a"
    assert config.initial_source.manifest is None


def test_the_boot_source_carries_its_manifest() -> None:
    """The operator counts a booted pod at the target version only when the agent's source
    equals ``spec.source``, manifest included."""
    from engine_agent.sidecar.main import build_config, parse_args

    args = ["--initial-source", "file:///models/a", "--initial-manifest", "/models/a/m.json"]
    config = build_config(parse_args(args))
    assert config.initial_source is not None
    assert config.initial_source.manifest == "/models/a/m.json"
    with pytest.raises(ValueError, match="--initial-manifest needs --initial-source"):
        build_config(parse_args(["--initial-manifest", "/models/a/m.json"]))
