"""Table-driven tests of the per-rank weight state machine (gap 1)."""

from __future__ import annotations

import pytest

from engine_agent.errors import UpdateConflict, WrongState
from engine_agent.protocol import EngineState, UpdateMode, UpdateSpec
from engine_agent.reload import session
from engine_agent.reload.session import WeightState

CLEAN = session.initial("v1")
POISONED = WeightState(EngineState.POISONED, "v1", "u0", poison_reason="half-failed")
#: v1 as committed by update "u0" (not the boot weights, though labelled alike).
COMMITTED = WeightState(EngineState.CLEAN, "v1", committed_by="u0")


def spec(mode: str = "full", **kw: object) -> UpdateSpec:
    extra: dict[str, object] = {"update_id": "u1", "version": "v2", "mode": mode}
    if mode in ("sparse", "partial"):
        extra["base_version"] = "v1"
    if mode == "partial":
        extra["scope"] = ["model.norm.weight"]
    return UpdateSpec.model_validate(extra | kw)


@pytest.mark.parametrize(
    ("start", "mode", "kw", "error"),
    [
        (CLEAN, "full", {}, None),
        (CLEAN, "partial", {}, None),
        (CLEAN, "partial", {"base_version": "v0"}, WrongState),  # a delta on another base
        (CLEAN, "sparse", {}, None),
        (CLEAN, "sparse", {"base_version": "v0"}, WrongState),
        (POISONED, "full", {}, None),
        (POISONED, "partial", {}, WrongState),
        (POISONED, "sparse", {}, WrongState),
        # a delta names the commit it builds on (None: the boot weights), not just its label:
        # a vLLM restarted onto boot weights labelled like u0's commit is not u0's base
        (CLEAN, "sparse", {"base_update_id": "u0"}, WrongState),
        (CLEAN, "partial", {"base_update_id": "u0"}, WrongState),
        (COMMITTED, "sparse", {}, WrongState),
        (COMMITTED, "partial", {}, WrongState),
        (COMMITTED, "sparse", {"base_update_id": "u0"}, None),
        (COMMITTED, "partial", {"base_update_id": "u0"}, None),
        (COMMITTED, "sparse", {"base_update_id": "u9"}, WrongState),
        (COMMITTED, "full", {}, None),
    ],
)
def test_begin(start: WeightState, mode: str, kw: dict[str, object], error: type | None) -> None:
    if error is None:
        opened = session.begin(start, spec(mode, **kw))
        assert opened.state is EngineState.OPEN and opened.target_version == "v2"
        assert not opened.serving_safe
    else:
        with pytest.raises(error):
            session.begin(start, spec(mode, **kw))


@pytest.mark.parametrize(
    ("start", "written", "outcome", "state", "version"),
    [
        # untouched session on a clean engine: still exactly v1
        (CLEAN, False, "fail", EngineState.CLEAN, "v1"),
        (CLEAN, False, "abort", EngineState.CLEAN, "v1"),
        # live bytes changed and the session did not commit: mixed weights
        (CLEAN, True, "fail", EngineState.POISONED, "v1"),
        (CLEAN, True, "abort", EngineState.POISONED, "v1"),
        # an empty start/finish on a poisoned engine never re-enables serving
        (POISONED, False, "fail", EngineState.POISONED, "v1"),
        (POISONED, False, "abort", EngineState.POISONED, "v1"),
        # only a commit (after every check passed) produces the new version
        (CLEAN, True, "commit", EngineState.CLEAN, "v2"),
        (POISONED, True, "commit", EngineState.CLEAN, "v2"),
    ],
)
def test_session_outcomes(
    start: WeightState, written: bool, outcome: str, state: EngineState, version: str
) -> None:
    ws = session.begin(start, spec())
    if written:
        ws = session.mark_written(ws)
        assert ws.state is EngineState.DIRTY
    if outcome == "commit":
        ws = session.commit(ws)
    elif outcome == "abort":
        ws = session.abort(ws)
    else:
        ws = session.fail(ws, "coverage incomplete")
    assert (ws.state, ws.version) == (state, version)
    assert ws.serving_safe is (state is EngineState.CLEAN)


def test_poisoned_keeps_its_first_reason_through_a_failed_recovery() -> None:
    ws = session.fail(session.begin(POISONED, spec()), "nothing loaded")
    assert ws.poison_reason == "half-failed"


def test_second_session_conflicts_and_a_repeated_begin_is_idempotent() -> None:
    ws = session.begin(CLEAN, spec())
    assert session.begin(ws, spec()) == ws
    with pytest.raises(UpdateConflict, match="u1"):
        session.begin(ws, spec(update_id="u2"))
    dirty = session.mark_written(ws)
    assert session.begin(dirty, spec()) == dirty  # a retried begin: the session goes on
    with pytest.raises(UpdateConflict):
        session.begin(dirty, spec(update_id="u2"))


@pytest.mark.parametrize("written", [False, True])
@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"version": "v3"}, "version: 'v2' began, 'v3' now"),
        ({"mode": "sparse", "base_version": "v1"}, "mode"),
        ({"mode": "partial", "base_version": "v1", "scope": ["model.norm."]}, "scope"),
    ],
)
def test_the_same_id_with_another_spec_is_a_conflict_open_or_dirty(
    written: bool, kw: dict[str, object], named: str
) -> None:
    """Issue 26, item 8: acknowledged while dirty, the caller believed the rank would commit
    what the second spec says."""
    ws = session.begin(CLEAN, spec())
    if written:
        ws = session.mark_written(ws)
    with pytest.raises(UpdateConflict) as refused:
        session.begin(ws, spec(**{"mode": "full", **kw}))  # type: ignore[arg-type]
    assert "'u1'" in refused.value.message and named in refused.value.message
    assert refused.value.field == "update_id"


def test_poison_fences_any_state() -> None:
    for start in (CLEAN, session.begin(CLEAN, spec()), POISONED):
        ws = session.poison(start, "peer rank wrote")
        assert ws.state is EngineState.POISONED and not ws.serving_safe


@pytest.mark.parametrize("call", [session.mark_written, session.commit])
def test_calls_outside_a_session_are_wrong_state(call: object) -> None:
    with pytest.raises(WrongState):
        call(CLEAN)  # type: ignore[operator]


def test_mode_field_rules() -> None:
    with pytest.raises(ValueError, match="baseVersion is required"):
        UpdateSpec(update_id="u", version="v", mode=UpdateMode.SPARSE)
    with pytest.raises(ValueError, match="scope must list"):
        UpdateSpec(update_id="u", version="v", mode=UpdateMode.PARTIAL)
    with pytest.raises(ValueError, match="scope is only allowed"):
        UpdateSpec(update_id="u", version="v", scope=["x"])
    with pytest.raises(ValueError, match="baseUpdateId is only allowed"):
        UpdateSpec(update_id="u", version="v", base_update_id="u0")


def test_a_delta_on_another_commit_names_both() -> None:
    with pytest.raises(WrongState, match=r"'u9'.*'u0'") as refused:
        session.begin(COMMITTED, spec("sparse", base_update_id="u9"))
    assert refused.value.field == "base_update_id"
    with pytest.raises(WrongState, match=r"boot load.*'u0'"):
        session.begin(COMMITTED, spec("partial"))


def test_a_rank_remembers_which_session_committed_what_it_serves() -> None:
    """The label alone cannot tell boot weights from a commit under the same label (a vLLM
    restarted onto them): the rank keeps the committing session's id until the next commit."""
    assert CLEAN.committed_by is None  # boot weights
    committed = session.commit(session.mark_written(session.begin(CLEAN, spec())))
    assert (committed.version, committed.committed_by, committed.update_id) == ("v2", "u1", None)
    other = spec(update_id="u2", version="v3")
    untouched = session.fail(session.begin(committed, other), "refused")
    assert (untouched.state, untouched.version, untouched.committed_by) == (
        EngineState.CLEAN,
        "v2",
        "u1",
    )
    poisoned = session.abort(session.mark_written(session.begin(committed, other)))
    assert (poisoned.state, poisoned.committed_by) == (EngineState.POISONED, "u1")
    again = session.commit(session.mark_written(session.begin(poisoned, other)))
    assert (again.state, again.version, again.committed_by) == (EngineState.CLEAN, "v3", "u2")
