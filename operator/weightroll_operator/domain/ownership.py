"""Which WeightUpdate drives a pod that several select: precedence, decided before any drain.

Per pod, the ``weightroll.io/owner`` annotation says which WeightUpdate drives it right now. That
alone leaves gaps (nothing is owned before the first claim, and a pod is released before the
next unit is claimed), so two WeightUpdates selecting the same pods would interleave: created
together, each drained a pod in its first pass (two out with ``maxUnavailable: 1``) and the
shared pod was reloaded three times (issue 27 item 3); with both ``Succeeded``, a new pod went to
whichever pass ran first, leaving a mixed fleet (item 11). The fleet-level rule, one order for
both cases, read from the objects alone (no pass order, no status written first):

**Order.** WeightUpdates are ordered by ``metadata.creationTimestamp``, then by name (the
apiserver's timestamp has one-second resolution; names are unique in a namespace, so the order
is total and every replica computes the same one).

**An unfinished older WeightUpdate goes first.** While a WeightUpdate that selects any of my
pods and is older than me has not finished (no ``completionTime`` for its current version) and
is not halted, I start nothing (condition ``Blocked``), from my very first pass: so two created
together never both drain. In-flight units of the younger (one that started before it saw the
older) finish; they are unavailable, so they use the older one's ``maxUnavailable`` budget
(``domain.availability``), and the budget holds across both.

**A finished WeightUpdate yields to any younger one.** Once I finished, a younger WeightUpdate
that selects a pod is the newer intent for it (as a new Deployment revision supersedes the
old): I never claim that pod again, and it counts as ``Superseded`` in my status (not as work,
so my ``Succeeded`` stands). A new pod therefore goes to the newest WeightUpdate that selects it.

The two rules never block each other: an older one blocks me only while it is unfinished, a
younger one supersedes me only once I finished.

**Claims rest on a fresh list.** A pass is handed its peers from the operator's index of
WeightUpdates, which may not hold one created together with it yet: handed such a view, each of
two created together drained a pod in its first pass (issue 27 item 3). So a pass that would
claim a pod it does not own yet decides precedence again on the API server's list of the
namespace's WeightUpdates and plans again if it differs (``reconcile``), as a claim rests on a
fresh agent answer; a failed list claims nothing. Every other step (in-flight units, restores,
the status) may go on the index's view: none of them starts a unit.

Limitations:
    * Two WeightUpdates created in the same second are ordered by name, not by which came
      first: a pass of the one later by name whose list ran before the other existed may have
      claimed a pod already. That unit finishes (it is never abandoned mid-load), then the
      other one goes first as above.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightroll_operator.api.v1alpha1 import Phase, parse_spec
from weightroll_operator.domain.fleet import matches
from weightroll_operator.domain.model import OwnerKey, PodView, owner_key

__all__ = ["HALTED_PHASES", "Precedence", "precedence", "seniority"]

#: A halted WeightUpdate starts nothing more, so it neither blocks nor supersedes (its owned
#: pods still block through their ``owner`` annotation; ``RollingBack`` still drains, so it
#: keeps its precedence).
HALTED_PHASES = frozenset({Phase.FAILED.value, Phase.ROLLED_BACK.value})


@dataclass(frozen=True, slots=True)
class Precedence:
    """What the other WeightUpdates of the namespace mean for mine this pass."""

    #: Older, unfinished WeightUpdates selecting any of my pods: I start nothing.
    blocked_by: tuple[str, ...] = ()
    #: My pods a younger WeightUpdate selects, once I finished: I leave them alone.
    superseded: frozenset[str] = frozenset()


def seniority(meta: Mapping[str, Any]) -> tuple[str, str]:
    """The sort key of a WeightUpdate: older first (``creationTimestamp``, then name)."""
    return (str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""))


def _finished(peer: Mapping[str, Any], version: str) -> bool:
    status = peer.get("status") or {}
    return bool(status.get("completionTime")) and status.get("targetVersion") == version


def precedence(
    owner: OwnerKey,
    my_meta: Mapping[str, Any],
    finished: bool,
    pods: tuple[PodView, ...],
    peers: Iterable[Mapping[str, Any]],
) -> Precedence:
    """The module's rule for ``owner`` (metadata ``my_meta``; ``finished``: it completed at its
    current version) over its selected ``pods``, given the namespace's WeightUpdates."""
    mine = seniority(my_meta)
    blocked: list[str] = []
    superseded: set[str] = set()
    for peer in peers:
        meta = peer.get("metadata") or {}
        key = owner_key(str(meta.get("namespace")), str(meta.get("name")))
        if key == owner or meta.get("deletionTimestamp"):
            continue
        older = seniority(meta) < mine
        if not older and not finished:
            continue
        if (peer.get("status") or {}).get("phase") in HALTED_PHASES:
            continue
        try:
            spec = parse_spec(peer.get("spec"))
        except ValueError:
            continue  # drives nothing, so holds nothing
        if older:
            if not _finished(peer, spec.version) and any(
                matches(spec.selector, p.labels) for p in pods
            ):
                blocked.append(str(key))
        else:
            superseded.update(p.name for p in pods if matches(spec.selector, p.labels))
    return Precedence(tuple(sorted(blocked)), frozenset(superseded))
