"""Status computation (counts, conditions, phase, change detection) and the status view."""

from __future__ import annotations

import pytest
from weightroll_operator.api.v1alpha1 import ConditionType, Phase
from weightroll_operator.domain.conditions import (
    get_condition,
    new_condition,
    remove_condition,
    set_condition,
)
from weightroll_operator.domain.model import UnitState, WeightState
from weightroll_operator.domain.plan import Persisted
from weightroll_operator.domain.status import build_status, status_patch
from weightroll_operator.status_view import render

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import ME, NOW, OTHER, agent, pod, run, spec, state


def test_golden_status_mid_rollout() -> None:
    s = spec(maxUnavailable=2)
    pods = [
        pod("p0", st=state(UnitState.VERIFIED)),
        pod("p1", gate=False, ready=False, st=state()),
        pod("p2"),
    ]
    p = run(s, pods, {"p1": agent(phase=UpdatePhase.LOADING), "p2": agent()})
    status = build_status(p, s, None, 3, NOW).to_json_dict()
    conds = {c["type"]: (c["status"], c["reason"]) for c in status.pop("conditions")}
    assert conds == {
        "Progressing": ("True", "RolloutProgressing"),
        "Verified": ("False", "ReplicasUnverified"),
        "Degraded": ("False", "NoFailures"),
        "Paused": ("False", "NotPaused"),
        "Blocked": ("False", "NotBlocked"),
    }
    assert status == {
        "phase": "Progressing",
        "observedGeneration": 3,
        "targetVersion": "v2",
        "replicas": {
            "total": 3,
            "updated": 1,
            "verified": 1,
            "draining": 2,
            "failed": 0,
            "stale": 0,
        },
        "stableVersion": "v1",
        "pods": [
            {"name": "p1", "state": "Updating", "version": "v2", "step": "Swapping"},
            {"name": "p2", "state": "Updating", "step": "Draining"},
            {"name": "p0", "state": "Verified", "version": "v2", "step": "Ready"},
        ],
        "startTime": "2026-01-01T12:00:00Z",
        "lastProgressTime": "2026-01-01T12:00:00Z",
        "message": "Progressing: 1/3 pods verified at v2; 2 updating",
    }


def _mine(st: UnitState = UnitState.DRAINING, previous: str = "v2") -> WeightState:
    return state(st, version="v3", previous_version=previous)


@pytest.mark.parametrize(
    ("states", "stable"),
    [
        # pods this WeightUpdate (to v3) claimed: what each served before it drained them
        ([_mine(UnitState.VERIFIED), _mine()], "v2"),
        # a fleet another WeightUpdate finished at v2 (whose pods served v1 before it): the
        # rollout to v3 starts from v2 (found by the getting-started page's test)
        ([state(UnitState.VERIFIED, by=OTHER), state(UnitState.VERIFIED, by=OTHER)], "v2"),
        ([state(UnitState.ROLLED_BACK, version="v1", by=OTHER), None], "v1"),
        ([_mine(), state(UnitState.VERIFIED, by=OTHER)], "v2"),
        # unknown, or pods disagreeing: no stable version is claimed
        ([state(UnitState.FAILED, by=OTHER), None], None),
        ([_mine(previous="v1"), state(UnitState.VERIFIED, by=OTHER)], None),
    ],
)
def test_stable_version_is_what_the_pods_served_before_this_rollout(
    states: list[WeightState | None], stable: str | None
) -> None:
    s = spec(_spec={"version": "v3", "source": {"uri": "/weights/v3"}})
    pods = [pod(f"p{i}", st=st) for i, st in enumerate(states)]
    the_plan = run(s, pods, {}, Persisted(target_version="v3"))
    assert build_status(the_plan, s, None, 1, NOW, owner=ME).stable_version == stable


def test_unchanged_status_is_not_written() -> None:
    s = spec()
    pods = [pod("p0", st=state(UnitState.VERIFIED))]
    done = Persisted(target_version="v2", completion_time="2026-01-01T11:00:00Z")
    first = build_status(run(s, pods, {}, done), s, None, 1, NOW)
    assert first.phase is Phase.SUCCEEDED
    raw = first.to_json_dict()
    assert status_patch(None, first) is not None
    second = build_status(run(s, pods, {}, done), s, first, 1, NOW)
    assert status_patch(raw, second) is None
    # keys we no longer set are removed with null (merge patch); only changed keys are sent,
    # so a concurrent patch of another key (weightroll abort/retry) is not overwritten
    assert status_patch({**raw, "abortReason": "x"}, second) == {"abortReason": None}
    assert status_patch({**raw, "phase": "Progressing"}, second) == {"phase": "Succeeded"}


def test_conditions_keep_transition_time_unless_status_flips() -> None:
    a = new_condition(ConditionType.PAUSED, False, "NotPaused", "", NOW)
    later = NOW.replace(hour=13)
    conds, changed = set_condition([a], new_condition(ConditionType.PAUSED, False, "X", "", later))
    assert changed and conds[0].last_transition_time == a.last_transition_time
    conds, changed = set_condition(conds, new_condition(ConditionType.PAUSED, True, "X", "", later))
    assert changed and conds[0].last_transition_time == "2026-01-01T13:00:00Z"
    _, changed = set_condition(conds, conds[0])
    assert not changed
    assert get_condition(conds, ConditionType.PAUSED) is not None
    conds, removed = remove_condition(conds, ConditionType.PAUSED)
    assert removed and conds == []


def test_phases() -> None:
    s = spec()
    aborted = Persisted(target_version="v2", aborted_at="x", abort_reason="FailureBudgetExceeded")
    failed = [pod("p0", gate=False, ready=False, st=state(UnitState.FAILED))]
    p = run(s, failed, {}, aborted)
    assert build_status(p, s, None, 1, NOW).phase is Phase.FAILED
    assert build_status(run(s, [], {}), s, None, 1, NOW).phase is Phase.PENDING
    paused = spec(_spec={"paused": True})
    p = run(paused, [pod("p0")], {"p0": agent()})
    assert build_status(p, paused, None, 1, NOW).phase is Phase.PAUSED  # created paused
    started = Persisted(target_version="v2", start_time="2026-01-01T11:00:00Z")
    p = run(paused, [pod("p0")], {"p0": agent()}, started)
    assert build_status(p, paused, None, 1, NOW).phase is Phase.PAUSED


def test_a_finished_rollout_with_a_pod_it_cannot_ask_is_not_succeeded() -> None:
    """After completion a pod joins whose agent does not answer: its version is unknown, so it
    still wants the version (as a pending pod does) and the phase is ``Progressing``, not
    ``Succeeded`` ("All selected pods serve v2"). It is reported unreachable (stale)."""
    s = spec()
    done = Persisted(
        target_version="v2",
        start_time="2026-01-01T10:00:00Z",
        completion_time="2026-01-01T11:00:00Z",
    )
    verified = pod("p0", st=state(UnitState.VERIFIED))
    joined = pod("p1", gate=None, ready=False)
    status = build_status(run(s, [verified, joined], {}, done), s, None, 1, NOW)
    assert status.phase is Phase.PROGRESSING
    assert status.replicas.stale == 1
    assert [(r.name, r.state) for r in status.pods if r.name == "p1"] == [("p1", "Unknown")]
    # once its agent answers at the version, the rollout is Succeeded again
    answered = run(s, [verified, pod("p1")], {"p1": agent(version="v2")}, done)
    assert build_status(answered, s, None, 1, NOW).phase is Phase.SUCCEEDED


def test_render_status_view() -> None:
    body = {
        "metadata": {"name": "wu", "namespace": "ml"},
        "spec": {"version": "v2"},
        "status": {
            "phase": "Failed",
            "message": "Failed: 1/2 pods verified at v2; 1 failed",
            "replicas": {"total": 2, "verified": 1, "failed": 1},
            "conditions": [{"type": "Degraded", "status": "True", "reason": "UnitsFailed"}],
            "pods": [{"name": "p1", "state": "Failed", "reason": "DigestMismatch"}],
        },
    }
    events = [{"lastTimestamp": "t1", "type": "Warning", "reason": "UnitFailed", "message": "m"}]
    text = render(body, events)
    assert "Phase:     Failed" in text
    assert "p1   Failed  -        DigestMismatch" in text
    assert "UnitFailed" in text and "total 2, updated 0, verified 1" in text


def test_listed_pods_are_the_first_of_a_full_sort() -> None:
    """``status.pods`` lists every failed pod, then the others by class order and name, up to
    ``MAX_POD_RESULTS``: the same as sorting them all (issue 11 G made it cheaper)."""
    import random

    from weightroll_operator.domain.plan import PodClass
    from weightroll_operator.domain.status import (
        _ALWAYS_LISTED,
        _RESULT_ORDER,
        MAX_POD_RESULTS,
        _listed,
    )

    assert set(_RESULT_ORDER) == set(PodClass)
    rnd = random.Random(7)
    for size in (0, 1, 10, MAX_POD_RESULTS, 400):
        for weights in ([1] * 10, [5, 1, 1, 1, 0, 0, 1, 0, 0, 30], [0, 0, 0, 0, 0, 0, 1, 0, 0, 1]):
            names = [f"p{rnd.randrange(10**6):06d}-{i}" for i in range(size)]
            classes = {n: rnd.choices(_RESULT_ORDER, weights=weights)[0] for n in names}
            full = sorted(classes.items(), key=lambda kv: (_RESULT_ORDER.index(kv[1]), kv[0]))
            expected = []
            for name, cls in full:
                if len(expected) >= MAX_POD_RESULTS and cls not in _ALWAYS_LISTED:
                    break
                expected.append((name, cls))
            assert _listed(classes) == expected


def test_a_pod_listed_verified_is_listed_at_the_spec_version_whatever_its_record_says() -> None:
    """spec.version went back to v1, which these pods serve in traffic; their records are
    about v2 (a failed attempt, a verdict the spec no longer names): history. The status listed them
    ``Verified`` at v2 (found by the simulation tier). A pod listed otherwise keeps its
    record's version."""
    s = spec(_spec={"version": "v1", "source": {"uri": "/weights/v1"}})
    pods = [
        pod("p0", st=state(UnitState.FAILED, reason="UpdateFailed: x")),
        pod("p1", st=state(UnitState.VERIFIED)),
        pod("p2", gate=False, ready=False, st=state()),  # in flight at v2: Updating at v2
        pod("p3"),
    ]
    v1 = {n: agent("v1") for n in ("p0", "p1", "p3")}
    p = run(s, pods, {**v1, "p2": agent(phase=UpdatePhase.LOADING)}, Persisted("v1"))
    listed = {r.name: (r.state, r.version) for r in build_status(p, s, None, 2, NOW).pods}
    assert listed == {
        "p0": ("Verified", "v1"),
        "p1": ("Verified", "v1"),
        "p2": ("Updating", "v2"),
        "p3": ("Verified", None),
    }
