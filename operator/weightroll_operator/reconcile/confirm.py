"""Between plan and apply: a unit's actions stand only while what they rest on still holds.

The planner decides once, on whatever the observer gives it, and names what each unit's claims,
re-attestations and withdrawals rest on (:class:`~weightroll_operator.domain.plan.Premise`): the
agent answers they were decided on and, for a claim of a pod not owned yet, the precedence among
the peers. It knows nothing of where those came from. This step does: some answers are an
earlier pass's (the observer's cache, ``observe.py``), and the index of WeightUpdates a pass is
handed may not hold a peer created together with this one yet (issue 27 item 3).

So it asks afresh only the agents whose premised answer was cached, and lists the WeightUpdates
from the API server only when a premise rests on the peers. Where a fresh answer differs from
the premised one (a trainer push since, which changes what the pod serves without touching the
pod), or the peers' precedence does, that unit's actions and the Events naming its pods are
dropped from this pass, as a pod write made on a stale ``resourceVersion`` is refused. The
fresh answers are the observer's (its cache keeps them), and the caller runs the next pass at
once, which plans on them (a unit dropped for its peers waits for the index to catch up, a
watch event away, so the caller polls then instead). The caller reports the dropped pods as it
reports any action that did not happen (``unsettled``, ``unwritten``).

Why not plan again here (as the reconciler once did, up to three times a pass): the plan is a
function of the observation; carrying the cache's protocol into its signature made the planner
know caches, and a pass plan up to three times. A dropped unit costs one pass more, at once,
and only when an answer changed under the cache.

Limitations: a listing of the peers that fails raises before anything is applied (no claim on
an unconfirmed view); a unit dropped for its peers is dropped again, each pass listing the peers,
until the index holds what the list holds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from weightroll_operator.domain.actions import Action, Emit
from weightroll_operator.domain.model import AgentView
from weightroll_operator.domain.plan import Premise, emit_holding

__all__ = ["Confirmed", "confirm"]

#: Asks the named pods' agents afresh (no cache): their answers, by pod name.
AskAfresh = Callable[[frozenset[str]], Awaitable[Mapping[str, AgentView]]]
#: Lists the peers from the API server: whether the precedence differs from the plan's.
PeersChanged = Callable[[], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The actions of a plan whose premises were checked."""

    #: The plan's actions less those of the dropped pods (Events naming them included).
    actions: tuple[Action, ...]
    #: Pods whose actions were dropped: a premise of theirs no longer holds.
    dropped: frozenset[str] = frozenset()
    #: The fresh answers asked for, by pod name (they replace the cached ones).
    answers: Mapping[str, AgentView] = field(default_factory=dict)
    #: Some pods were dropped because an agent's answer changed: the next pass, which plans
    #: on the fresh answers (cached now), may run at once.
    answer_changed: bool = False


async def confirm(
    actions: Sequence[Action],
    premises: Iterable[Premise],
    cached: Set[str],
    ask_afresh: AskAfresh,
    peers_changed: PeersChanged | None = None,
) -> Confirmed:
    """Check the ``premises`` of a plan's ``actions``; drop the units whose premise fails.

    Args:
        actions: the plan's actions, in order.
        premises: what they rest on, per unit (``Plan.premises``).
        cached: the pods whose agent answer this pass was an earlier pass's; the others'
            answers are this pass's and hold.
        ask_afresh: asks agents again, bypassing the cache.
        peers_changed: lists the peers afresh (``None``: they cannot be listed, the index
            is all there is).

    Returns:
        The actions that stand, the pods dropped, the fresh answers.

    Raises:
        KubeError: ``peers_changed`` could not list the peers (nothing is applied then).
    """
    premises = tuple(premises)
    recheck = frozenset(n for p in premises for n in p.pods if n in cached)
    on_peers = [p for p in premises if p.peers]
    if not recheck and not (on_peers and peers_changed is not None):
        return Confirmed(tuple(actions))
    answers = dict(await ask_afresh(recheck)) if recheck else {}
    peers_differ = bool(on_peers) and peers_changed is not None and await peers_changed()
    changed = [
        p
        for p in premises
        if any(n in answers and answers[n] != seen for n, seen in p.answers.items())
    ]
    dropped = frozenset(n for p in (*changed, *(on_peers if peers_differ else ())) for n in p.pods)
    if not dropped:
        return Confirmed(tuple(actions), answers=answers)
    return Confirmed(_without(actions, dropped), dropped, answers, bool(changed))


def _without(actions: Sequence[Action], dropped: frozenset[str]) -> tuple[Action, ...]:
    """``actions`` less those of the pods ``dropped`` and the Events reporting them."""
    kept: list[Action] = []
    for a in actions:
        if isinstance(a, Emit):
            held = emit_holding(a, dropped)
            if held is not None:
                kept.append(held)
        elif a.pod.name not in dropped:
            kept.append(a)
    return tuple(kept)
