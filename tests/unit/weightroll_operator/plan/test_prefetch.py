"""Table tests of steps 2b and 5c, units that prefetch before they are claimed
(``domain/plan/prefetch.py``), and of the swap in step 2 (``advance.py``): issue 30 item 3.

With ``strategy.prefetch.mode: Host`` a unit is staged (``Prefetching``: owned, gate untouched,
outside ``maxUnavailable``, at most ``maxConcurrent``), drained only once every agent says
``Prefetched``, and swapped only once the drain is observed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from weightroll_operator.domain.actions import Claim, Settle, StartUpdate, SwapUpdate
from weightroll_operator.domain.model import AgentView, PodView, UnitState, UpdateView
from weightroll_operator.domain.plan import Persisted, PodClass
from weightroll_operator.domain.plan.settle import pod_step
from weightroll_operator.domain.plan.start import budget

from engine_agent.protocol import UpdatePhase
from tests.unit.weightroll_operator.builders import (
    ME,
    V2,
    agent,
    classified,
    pod,
    run,
    spec,
    state,
    summary,
)

HOST: dict[str, Any] = {"mode": "Host"}
IDLE = agent("v1")


def staged(name: str, **kw: Any) -> PodView:
    """A pod staged for its prefetch: owned, ``Prefetching``, still in traffic."""
    return pod(name, st=state(UnitState.PREFETCHING, update_id=f"wu-v2-{name}"), **kw)


def prefetch(name: str, phase: UpdatePhase, *reasons: str) -> AgentView:
    """Its agent's answer about the staged attempt (the agent still serves v1)."""
    return agent("v1", phase=phase, update_id=f"wu-v2-{name}", reasons=reasons)


def claims(p: Any) -> dict[str, UnitState]:
    return {a.pod.name: a.state.state for a in p.actions if isinstance(a, Claim)}


@pytest.mark.parametrize(
    ("strategy", "pods", "agents", "expected"),
    [
        pytest.param(
            {"maxUnavailable": 1, "prefetch": {**HOST, "maxConcurrent": 2}},
            [pod("p0"), pod("p1"), pod("p2")],
            {n: IDLE for n in ("p0", "p1", "p2")},
            # two units staged, none drained: the budget is not touched by a prefetch
            [("Claim", "p0"), ("Emit", "UnitPrefetching"), ("Claim", "p1")],
            id="staged-ahead-of-the-budget-up-to-maxConcurrent",
        ),
        pytest.param(
            {"maxUnavailable": 2, "prefetch": HOST},
            [pod("p0"), pod("p1"), pod("p2")],
            {n: IDLE for n in ("p0", "p1", "p2")},
            [("Claim", "p0"), ("Emit", "UnitPrefetching"), ("Claim", "p1")],
            id="maxConcurrent-defaults-to-one-batch",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST},
            [staged("p0"), pod("p1")],
            {"p0": IDLE, "p1": IDLE},
            [("StartUpdate", "p0")],
            id="staged-unit-is-asked-to-prefetch-and-holds-the-only-prefetch-slot",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST},
            [staged("p0"), pod("p1")],
            {"p0": prefetch("p0", UpdatePhase.PREFETCHING), "p1": IDLE},
            [],
            id="still-reading-nothing-to-do",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST},
            [staged("p0"), pod("p1")],
            {"p0": prefetch("p0", UpdatePhase.PREFETCHED), "p1": IDLE},
            # verified: drained for the attempt it runs; its prefetch slot goes to p1
            [
                ("Claim", "p0"),
                ("GateOff", "p0"),
                ("Emit", "UnitDraining"),
                ("Claim", "p1"),
                ("Emit", "UnitPrefetching"),
            ],
            id="prefetched-unit-is-drained-and-the-next-one-staged",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST},
            [pod("p0", gate=False, ready=False, st=state(update_id="wu-v2-p0")), staged("p1")],
            {
                "p0": prefetch("p0", UpdatePhase.PREFETCHED),
                "p1": prefetch("p1", UpdatePhase.PREFETCHED),
            },
            # p0 observed drained: the go; p1 verified too, but the budget is p0's
            [("SwapUpdate", "p0")],
            id="drained-unit-is-swapped-the-next-waits-for-a-slot",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST},
            [pod("p0", gate=False, ready=True, st=state(update_id="wu-v2-p0"))],
            {"p0": prefetch("p0", UpdatePhase.PREFETCHED)},
            [],
            id="no-swap-before-the-drain-is-observed",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST},
            [pod("p0"), pod("p1", gate=None, ready=False)],
            {"p0": IDLE, "p1": IDLE},
            # p1 is out of traffic already (a new pod): nothing to gain by reading ahead, and
            # staging it would hold the prefetch slot p0 needs (found by the simulation tier)
            [
                ("Claim", "p1"),
                ("GateOff", "p1"),
                ("Emit", "UnitDraining"),
                ("Claim", "p0"),
                ("Emit", "UnitPrefetching"),
            ],
            id="unit-out-of-traffic-is-claimed-at-once",
        ),
        pytest.param(
            {"maxUnavailable": 1, "prefetch": HOST, "canary": 1},
            [pod("p0"), pod("p1")],
            {"p0": IDLE, "p1": IDLE},
            # the canary is the test: drained first, prefetched inside its drain
            [("Claim", "p0"), ("GateOff", "p0"), ("Emit", "UnitDraining")],
            id="canary-is-drained-first",
        ),
    ],
)
def test_prefetch_ahead_steps(
    strategy: dict[str, Any],
    pods: list[PodView],
    agents: dict[str, AgentView],
    expected: list[tuple[str, str]],
) -> None:
    assert summary(run(spec(**strategy), pods, agents)) == expected


def test_the_staged_attempt_is_the_drained_one_and_awaits_its_swap() -> None:
    s = spec(maxUnavailable=1, prefetch=HOST)
    first = run(s, [pod("p0")], {"p0": IDLE})
    (stage,) = [a for a in first.actions if isinstance(a, Claim)]
    assert stage.state.state is UnitState.PREFETCHING and stage.remove_label is None
    assert first.classes["p0"] is PodClass.PREFETCHING and first.in_flight_units == 0

    asked = run(s, [pod("p0", st=stage.state, owner=ME)], {"p0": IDLE})
    (start,) = [a for a in asked.actions if isinstance(a, StartUpdate)]
    assert start.request.id == stage.state.update_id
    assert start.request.prefetch.await_swap

    ready = prefetch("p0", UpdatePhase.PREFETCHED)
    ready = replace(ready, update=replace(ready.update, id=stage.state.update_id))  # type: ignore[arg-type]
    drained = run(s, [pod("p0", st=stage.state, owner=ME)], {"p0": ready})
    assert claims(drained) == {"p0": UnitState.DRAINING}
    (claim,) = [a for a in drained.actions if isinstance(a, Claim)]
    assert claim.state.update_id == stage.state.update_id


def test_a_unit_claimed_after_its_prefetch_times_from_its_drain() -> None:
    """The agent accepted the update two hours before the drain: no UpdateTimeout for that."""
    st = state(update_id="wu-v2-p0", started="2026-01-01T11:59:00Z")
    update = UpdateView(
        id="wu-v2-p0",
        phase=UpdatePhase.PREFETCHED,
        version="v2",
        started_at="2026-01-01T10:00:00Z",
    )
    p = run(
        spec(maxUnavailable=1, prefetch=HOST, updateTimeoutSeconds=600),
        [pod("p0", gate=False, ready=False, st=st)],
        {"p0": AgentView(reachable=True, version="v2", update=update)},
    )
    assert [type(a) for a in p.actions] == [SwapUpdate]


def test_a_failed_prefetch_fails_the_unit_serving_and_counts_against_the_failure_budget() -> None:
    s = spec(maxUnavailable=1, maxFailedReplicas=0, prefetch=HOST)
    agents = {"p0": prefetch("p0", UpdatePhase.FAILED, "manifest_mismatch: bytes differ")}
    p = run(s, [staged("p0"), pod("p1")], {**agents, "p1": IDLE})

    (settle,) = [a for a in p.actions if isinstance(a, Settle)]
    assert settle.state.state is UnitState.FAILED and not settle.release
    assert settle.state.reason == "PrefetchFailed: manifest_mismatch: bytes differ"
    assert not any(type(a).__name__ in ("GateOff", "GateOn") for a in p.actions)
    assert p.classes["p0"] is PodClass.FAILED
    assert p.reasons["p0"] == settle.state.reason
    # one failure more than maxFailedReplicas: halted, nothing new staged
    assert p.persisted.abort_reason == "FailureBudgetExceeded"
    assert "p1" not in claims(p)


def test_a_failed_prefetch_serving_uses_no_slot_a_drained_failure_does() -> None:
    failed = state(UnitState.FAILED, reason="PrefetchFailed: x")
    serving = pod("p0", st=failed, owner=ME)
    drained = pod("p0", gate=False, ready=False, st=failed, owner=ME)
    for p0, slots in ((serving, 1), (drained, 0)):
        _, _, seen = classified([p0, pod("p1")], maxUnavailable=1, prefetch=HOST)
        assert budget(seen, frozenset()) == slots


@pytest.mark.parametrize(
    ("answer", "persisted"),
    [
        # nobody swapped in time (the agent freed the staging): wanted again, not failed
        (prefetch("p0", UpdatePhase.FAILED, "swap_deadline: no swap within 600s"), V2),
        (prefetch("p0", UpdatePhase.ABORTED, "aborted: update aborted by request"), V2),
        (prefetch("p0", UpdatePhase.FAILED, "agent_restarted: during Prefetched"), V2),
        # the rollout halted: a failure is no verdict any more either
        (
            prefetch("p0", UpdatePhase.FAILED, "manifest_mismatch: x"),
            Persisted("v2", aborted_at="2026-01-01T11:00:00Z", abort_reason="AbortedByUser"),
        ),
    ],
)
def test_a_prefetch_that_ended_without_a_verdict_is_released(
    answer: AgentView, persisted: Persisted
) -> None:
    p = run(spec(maxUnavailable=1, prefetch=HOST), [staged("p0")], {"p0": answer}, persisted)
    (settle,) = [a for a in p.actions if isinstance(a, Settle)]
    assert settle.state.state is UnitState.WITHDRAWN and settle.release
    assert settle.state.reason.startswith("PrefetchReleased: ")
    assert p.classes["p0"] is PodClass.PENDING
    assert "p0" not in p.reasons


@pytest.mark.parametrize(
    "phase", [UpdatePhase.PREFETCHING, UpdatePhase.PREFETCHED, UpdatePhase.PENDING]
)
def test_a_halt_aborts_every_prefetch(phase: UpdatePhase) -> None:
    halted = Persisted("v2", aborted_at="2026-01-01T11:00:00Z", abort_reason="AbortedByUser")
    p = run(
        spec(maxUnavailable=1, prefetch=HOST), [staged("p0")], {"p0": prefetch("p0", phase)}, halted
    )
    assert summary(p) == [("AbortUpdate", "p0")]


def test_spec_moved_on_aborts_the_prefetch() -> None:
    s = spec(maxUnavailable=1, prefetch=HOST, _spec={"version": "v3", "source": {"uri": "/w/v3"}})
    p = run(s, [staged("p0")], {"p0": prefetch("p0", UpdatePhase.PREFETCHED)}, Persisted("v3"))
    assert ("AbortUpdate", "p0") in summary(p)
    assert "p0" not in claims(p)


def test_a_rollback_leaves_a_failed_prefetch_serving() -> None:
    """Halted with onFailure Rollback: the verified unit is rolled back in place; the one
    whose prefetch failed never left its previous weights and is not drained for them."""
    halted = Persisted(
        "v2", aborted_at="2026-01-01T11:00:00Z", abort_reason="FailureBudgetExceeded"
    )
    pods = [
        pod(
            "p0",
            st=state(UnitState.FAILED, reason="PrefetchFailed: manifest_mismatch: x"),
            owner=ME,
        ),
        pod("p1", st=state(UnitState.VERIFIED)),
    ]
    p = run(
        spec(maxUnavailable=2, prefetch=HOST, onFailure="Rollback"),
        pods,
        {"p0": IDLE, "p1": agent("v2")},
        halted,
    )
    assert claims(p) == {"p1": UnitState.ROLLING_BACK}


@pytest.mark.parametrize(
    ("cls", "view", "gate", "step"),
    [
        (PodClass.PREFETCHING, agent("v1"), True, "Prefetching"),
        (PodClass.PREFETCHING, prefetch("p0", UpdatePhase.PREFETCHING), True, "Prefetching"),
        (PodClass.PREFETCHING, prefetch("p0", UpdatePhase.PREFETCHED), True, "Prefetched"),
        (PodClass.IN_FLIGHT, prefetch("p0", UpdatePhase.PREFETCHED), False, "Draining"),
        (PodClass.IN_FLIGHT, None, False, "Draining"),
        (PodClass.IN_FLIGHT, prefetch("p0", UpdatePhase.DRAINING), False, "Swapping"),
        (PodClass.IN_FLIGHT, prefetch("p0", UpdatePhase.LOADING), False, "Swapping"),
        (PodClass.IN_FLIGHT, prefetch("p0", UpdatePhase.VERIFYING), False, "Verifying"),
        (PodClass.IN_FLIGHT, agent(phase=UpdatePhase.COMMITTED), False, "Verifying"),
        (PodClass.UPDATED, agent("v2"), True, "Ready"),
        (PodClass.UPDATED, agent("v2"), False, None),  # its gate not back on yet
        (PodClass.PENDING, agent("v1"), True, None),
    ],
)
def test_each_pod_s_step(
    cls: PodClass, view: AgentView | None, gate: bool, step: str | None
) -> None:
    st = state(UnitState.VERIFIED if cls is PodClass.UPDATED else UnitState.DRAINING)
    assert pod_step(cls, pod("p0", gate=gate, st=st), view, set()) == step


def test_a_group_staged_in_part_is_given_up_and_staged_whole_again() -> None:
    """p1's claim write failed: the group is never drained with p1 unread."""
    pods = [staged("p0", unit="g"), pod("p1", unit="g")]
    s = spec(maxUnavailable=1, prefetch=HOST)
    p = run(s, pods, {"p0": prefetch("p0", UpdatePhase.PREFETCHED), "p1": IDLE})
    assert summary(p) == [("AbortUpdate", "p0")]
    ended = prefetch("p0", UpdatePhase.ABORTED, "aborted: update aborted by request")
    p = run(s, pods, {"p0": ended, "p1": IDLE})
    assert [(type(a).__name__, a.state.state) for a in p.actions if isinstance(a, Settle)] == [
        ("Settle", UnitState.WITHDRAWN)
    ]


def test_failed_prefetches_hold_no_slot_in_the_all_slots_failed_halt() -> None:
    """maxUnavailable 50% of 4 (2), maxFailedReplicas 3: two failed units that are drained
    hold every slot while units wait (halt); two whose prefetch failed serve and hold none."""
    s = spec(maxUnavailable="50%", maxFailedReplicas=3, prefetch=HOST)
    failed = state(UnitState.FAILED, reason="PrefetchFailed: manifest_mismatch: x")
    waiting = [pod("p2"), pod("p3")]
    serving = [pod(n, st=failed, owner=ME) for n in ("p0", "p1")]
    drained = [pod(n, gate=False, ready=False, st=failed, owner=ME) for n in ("p0", "p1")]
    idle = {n: IDLE for n in ("p0", "p1", "p2", "p3")}
    assert run(s, [*serving, *waiting], idle).persisted.aborted_at is None
    assert run(s, [*drained, *waiting], idle).persisted.abort_reason == "FailureBudgetExceeded"


def test_a_group_whose_prefetch_failed_on_one_pod_fails_whole_and_serves() -> None:
    pods = [staged("p0", unit="g"), staged("p1", unit="g")]
    agents = {
        "p0": prefetch("p0", UpdatePhase.FAILED, "prefetch_memory: 9 GiB above maxBytes"),
        "p1": prefetch("p1", UpdatePhase.PREFETCHED),
    }
    p = run(spec(maxUnavailable=1, prefetch=HOST), pods, agents)
    settles = [a for a in p.actions if isinstance(a, Settle)]
    assert {a.pod.name: a.state.state for a in settles} == {
        "p0": UnitState.FAILED,
        "p1": UnitState.FAILED,
    }
    # one reason for the unit, still a prefetch failure (rollback and the slot count read it)
    assert {a.state.reason for a in settles} == {
        "PrefetchFailed: p0: prefetch_memory: 9 GiB above maxBytes"
    }
    steps = summary(p)
    assert steps.index(("AbortUpdate", "p1")) > steps.index(("Settle", "p1"))  # after the verdict
    assert not any(type(a).__name__ == "GateOff" for a in p.actions)
