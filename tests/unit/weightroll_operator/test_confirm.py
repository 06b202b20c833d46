"""The confirm step between plan and apply (``reconcile/confirm.py``): a unit's actions stand
only while what they rest on (``Plan.premises``) holds; only cached answers are asked again,
and the peers are listed only for a claim that rests on them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest
from weightroll_operator.domain.actions import Action, Claim, Emit, GateOff
from weightroll_operator.domain.model import AgentView, UnitState
from weightroll_operator.domain.plan import Premise, aggregate_emits
from weightroll_operator.reconcile.confirm import Confirmed, confirm

from tests.unit.weightroll_operator.builders import ME, agent, pod, state

V1, PUSHED = agent("v1"), agent("step-7")
P0, P1, P2 = pod("p0", unit="g"), pod("p1", unit="g"), pod("p2")


def _claim(p: object) -> list[Action]:
    st = state(UnitState.DRAINING)
    return [Claim(p, ME, st), GateOff(p)]  # type: ignore[arg-type]


_DRAINING = aggregate_emits(
    [
        Emit("UnitDraining", "Draining group g", pods=("p0", "p1")),
        Emit("UnitDraining", "Draining p2", pods=("p2",)),
    ]
)
assert _DRAINING is not None
#: A group g (p0, p1) and a single pod p2 claimed, with their Events aggregated as a pass posts
#: them.
ACTIONS: tuple[Action, ...] = (*_claim(P0), *_claim(P1), *_claim(P2), _DRAINING)
PREMISES = (
    Premise(("p0", "p1"), {"p0": V1, "p1": V1}, peers=True),
    Premise(("p2",), {"p2": V1}, peers=True),
)


def _pods(actions: tuple[Action, ...]) -> list[str]:
    return sorted({a.pod.name for a in actions if not isinstance(a, Emit)})


def _events(actions: tuple[Action, ...]) -> list[str]:
    return [m for a in actions if isinstance(a, Emit) for m in (p.message for p in a.parts or (a,))]


def _run(
    cached: set[str], fresh: Mapping[str, AgentView], peers_differ: bool | None = False
) -> tuple[Confirmed, list[frozenset[str]], list[bool]]:
    asked: list[frozenset[str]] = []
    listed: list[bool] = []

    async def ask(names: frozenset[str]) -> Mapping[str, AgentView]:
        asked.append(names)
        return {n: fresh[n] for n in names}

    async def peers() -> bool:
        listed.append(True)
        return bool(peers_differ)

    got = asyncio.run(
        confirm(ACTIONS, PREMISES, cached, ask, None if peers_differ is None else peers)
    )
    return got, asked, listed


@pytest.mark.parametrize(
    ("case", "cached", "fresh", "peers_differ", "kept", "dropped"),
    [
        ("fresh answers: nothing asked", set(), {}, False, ["p0", "p1", "p2"], []),
        ("cached, the same afresh: applied", {"p0", "p2"}, {"p0": V1, "p2": V1}, False,
         ["p0", "p1", "p2"], []),
        ("cached, differs afresh: dropped", {"p2"}, {"p2": PUSHED}, False, ["p0", "p1"], ["p2"]),
        ("one pod of a group differs: the whole unit", {"p1", "p2"}, {"p1": PUSHED, "p2": V1},
         False, ["p2"], ["p0", "p1"]),
        ("did not answer afresh: dropped", {"p2"}, {"p2": AgentView(reachable=False)}, False,
         ["p0", "p1"], ["p2"]),
        ("peers differ: every claim resting on them", set(), {}, True, [], ["p0", "p1", "p2"]),
        ("peers cannot be listed: the index stands", set(), {}, None, ["p0", "p1", "p2"], []),
    ],
)  # fmt: skip
def test_confirm(
    case: str,
    cached: set[str],
    fresh: Mapping[str, AgentView],
    peers_differ: bool | None,
    kept: list[str],
    dropped: list[str],
) -> None:
    got, asked, listed = _run(cached, fresh, peers_differ)
    assert _pods(got.actions) == kept, case
    assert sorted(got.dropped) == dropped, case
    # only the cached answers a premise names are asked again, once, and kept as fresh
    assert asked == ([frozenset(cached)] if cached else []), case
    assert dict(got.answers) == {n: fresh[n] for n in cached}, case
    assert listed == ([True] if peers_differ is not None else []), case
    # only a changed answer calls for the next pass at once (peers: the index must catch up)
    assert got.answer_changed is bool(
        set(dropped) - ({"p0", "p1", "p2"} if peers_differ else set())
    )
    # an Event reporting a dropped pod goes with it; the others' stay
    assert _events(got.actions) == [
        m for m, pods in (("Draining group g", "p0"), ("Draining p2", "p2")) if pods in kept
    ], case


def test_premises_not_on_the_peers_list_nothing() -> None:
    """A withdrawal or a re-attestation rests on its agent only: no listing of the peers."""
    listed: list[bool] = []

    async def peers() -> bool:
        listed.append(True)
        return True

    async def ask(names: frozenset[str]) -> Mapping[str, AgentView]:
        return {n: V1 for n in names}

    premises = (Premise(("p2",), {"p2": V1}),)
    got = asyncio.run(confirm(ACTIONS, premises, {"p2"}, ask, peers))
    assert (got.actions, got.dropped, listed) == (ACTIONS, frozenset(), [])


def test_no_premise_no_question() -> None:
    async def never(*_: object) -> object:
        raise AssertionError("asked")

    got = asyncio.run(confirm(ACTIONS, (), {"p0", "p1", "p2"}, never, never))  # type: ignore[arg-type]
    assert got == Confirmed(ACTIONS)
