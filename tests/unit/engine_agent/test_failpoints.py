"""The ``signal:`` and ``wait:`` failpoint actions that order one rank against a test."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_agent.errors import SourceUnavailable
from engine_agent.protocol import RankId
from engine_agent.reload import failpoints

TP0, TP1 = RankId(dp=0, pp=0, tp=0), RankId(dp=0, pp=0, tp=1)


def test_signal_creates_its_file_on_the_named_rank_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signal = tmp_path / "read"
    monkeypatch.setenv(failpoints.ENV, f"load.read@tp0=signal:{signal}")
    failpoints.check("load.read", TP1)
    assert not signal.exists()
    failpoints.check("load.read", TP0)
    assert signal.exists()


def test_wait_goes_on_once_its_file_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    go = tmp_path / "go"
    go.touch()
    monkeypatch.setenv(failpoints.ENV, f"load@tp1=wait:{go}")
    failpoints.check("load", TP1)


def test_wait_fails_the_call_when_its_file_never_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failpoints, "WAIT_LIMIT_SECONDS", 0.0)
    monkeypatch.setenv(failpoints.ENV, f"load@tp1=wait:{tmp_path / 'never'}")
    with pytest.raises(SourceUnavailable, match="injected failure of load on rank"):
        failpoints.check("load", TP1)
