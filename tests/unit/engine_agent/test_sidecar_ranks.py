"""Table-driven tests of the all-rank agreement rules (``engine_agent.sidecar.ranks``)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_agent.protocol import EngineState
from engine_agent.sidecar.ranks import (
    check_commit,
    check_session,
    collect_reports,
    collect_states,
    worst_state,
)


def report(tp: int = 0, dp: int = 0, **fields: Any) -> dict[str, Any]:
    """A finish report of a rank that committed ``v2`` in update ``u-1``."""
    base: dict[str, Any] = {
        "rank": {"dp": dp, "pp": 0, "tp": tp, "ep": 0},
        "call": "finish",
        "ok": True,
        "state": "clean",
        "version": "v2",
        "updateId": "u-1",
        "required": 10,
        "received": 10,
        "coverageHash": "cov",
        "digest": f"digest-tp{tp}",
    }
    base.update(fields)
    return base


def codes(results: list[Any], world: int = 2) -> list[str]:
    round_ = check_commit(collect_reports("weightroll_finish", results, world), "u-1", "v2")
    return [problem.code for problem in round_.problems]


@pytest.mark.parametrize(
    ("results", "world", "expected"),
    [
        ([report(0), report(1)], 2, []),
        ([report(0)], 2, ["rank_missing"]),
        ([], 1, ["rank_missing"]),
        ([report(0), report(0)], 2, ["rank_duplicate"]),
        ([report(0), report(1), report(2)], 2, ["rank_unexpected"]),
        ([report(0), {"bogus": 1}], 2, ["rank_malformed"]),
        ([report(0), None], 2, ["rank_malformed"]),
        ([report(0), "Traceback ..."], 2, ["rank_malformed"]),
        (
            [report(0), report(1, ok=False, error={"code": "coverage_incomplete", "message": "x"})],
            2,
            ["coverage_incomplete"],
        ),
        (
            [report(0), report(1, ok=False, error={"code": "weird", "message": "x"})],
            2,
            ["rank_error"],
        ),
        ([report(0), report(1, updateId="u-9")], 2, ["update_id_mismatch"]),
        ([report(0), report(1, version="v1")], 2, ["version_mismatch"]),
        ([report(0), report(1, state="poisoned")], 2, ["not_committed"]),
        ([report(0), report(1, coverageHash="other")], 2, ["coverage_hash_mismatch"]),
        ([report(0), report(1, coverageHash="")], 2, ["coverage_hash_missing"]),
        ([report(0), report(1, digest="")], 2, ["digest_missing"]),
        (
            [report(0), report(1, missing=["layers.0.qkv:k"], missingCount=3)],
            2,
            ["coverage_incomplete"],
        ),
        ([report(0), report(1, duplicates=["layers.0.qkv:q"])], 2, ["duplicate_shard"]),
        ([report(0), report(1, identityOk=False)], 2, ["identity_changed"]),
        ([report(0), report(1, identityProblems=["ptr moved"])], 2, ["identity_changed"]),
        # Data-parallel replicas of the same shard must hold the same bytes.
        ([report(0, dp=0), report(0, dp=1)], 2, []),
        ([report(0, dp=0), report(0, dp=1, digest="different")], 2, ["digest_mismatch"]),
    ],
    ids=lambda value: None if isinstance(value, list | int) else str(value),
)
def test_commit_rules(results: list[Any], world: int, expected: list[str]) -> None:
    assert codes(results, world) == expected


def test_problem_messages_name_ranks_and_values() -> None:
    round_ = check_commit(
        collect_reports(
            "weightroll_finish",
            [report(0), report(1, missing=["a", "b"], missingCount=2, coverageHash="zzz")],
            2,
        ),
        "u-1",
        "v2",
    )
    text = "\n".join(map(str, round_.problems))
    assert "rank dp0:pp0:tp1:ep0 is missing 2 shard(s): a, b" in text
    assert "dp0:pp0:tp1:ep0=zzz" in text


def test_many_failed_ranks_are_summarised() -> None:
    results = [
        report(tp, ok=False, error={"code": "source_unavailable", "message": "gone"})
        for tp in range(12)
    ]
    round_ = collect_reports("weightroll_load", results, 12)
    assert len(round_.problems) == 9
    assert str(round_.problems[-1]) == "rank_error: weightroll_load failed on 4 more ranks"


def test_session_check_ignores_version_but_not_id() -> None:
    round_ = collect_reports("weightroll_begin", [report(0, version="v1", state="open")], 1)
    assert check_session(round_, "u-1").ok
    assert not check_session(round_, "u-2").ok


def status(tp: int, state: str = "clean", version: str = "v1") -> dict[str, Any]:
    return {
        "rank": {"dp": 0, "pp": 0, "tp": tp},
        "state": state,
        "version": version,
        "servingSafe": state == "clean",
    }


@pytest.mark.parametrize(
    ("results", "expected_state", "expected_codes"),
    [
        ([status(0), status(1)], EngineState.CLEAN, []),
        ([status(0), status(1, "poisoned")], EngineState.POISONED, ["state_mismatch"]),
        ([status(0, "dirty"), status(1, "dirty")], EngineState.DIRTY, []),
        ([status(0), status(1, version="v2")], EngineState.CLEAN, ["version_mismatch"]),
        ([status(0)], EngineState.CLEAN, ["rank_missing"]),
    ],
)
def test_state_rules(
    results: list[Any], expected_state: EngineState, expected_codes: list[str]
) -> None:
    round_ = collect_states(results, 2)
    assert round_.state is expected_state
    assert [problem.code for problem in round_.problems] == expected_codes


def test_worst_state_orders_by_severity() -> None:
    assert worst_state([]) is None
    assert worst_state([EngineState.OPEN, EngineState.CLEAN]) is EngineState.OPEN
    assert worst_state([EngineState.DIRTY, EngineState.POISONED]) is EngineState.POISONED
