"""What our readiness gate vouches for, and whether it still does (pure).

A gate set True says "these containers serve these weights": the version, the update that
committed them (``None``: ranks that booted at the version, a cold engine being the oracle
itself) and the pod's incarnation (:attr:`~.model.PodView.incarnation`) the answer came from.
That is a fact about the *gate*, not about the unit's record, so it is kept with the record
(``weight-state``'s ``gate`` field) whatever state the record moves to, and judged on every pass
whatever that state is.

It was once left implicit in the record's verdict: only ``Verified``/``RolledBack`` records were
judged (``domain.standing``). A verified pod claimed to prefetch its next version keeps its gate
(it serves while it reads ahead), but its record became ``Prefetching``, then ``Withdrawn`` when
the prefetch ended: nothing judged the gate any more. Its containers restarted without the
agent's state onto the boot weights v1, and the pod stayed Ready under the gate set for v2 for as
long as other units held the budget (found by ``make soak`` with prefetching).

:func:`breach` says why a vouch no longer holds, judged on the pod's agent:

* a reachable, ready agent that serves another version, or the version committed by another
  update: the gate is attested again for what the agent serves (its ranks either booted on it or
  committed it through a verified update), or, where the caller cannot attest it, taken off;
* an agent that does not answer, on containers other than the vouched ones: nothing says what
  they serve, so the gate goes off (fail closed). A vouch that names no containers (a record
  older than the incarnation field) is judged on answers only, as it was;
* an answering agent that is not ready holds the pod out of traffic itself (its ``/readyz``), and
  a silent one on the vouched containers is guarded by that probe: the vouch stands.

Backward compatibility: records written before the field carry no vouch and are read as they
are (the wire format only gains an optional ``gate`` key); ``standing.vouch_of`` *derives* their
vouch at use, fail-closed: a verdict's (``Verified``/``RolledBack``: its version, update id and
incarnation are exactly what its GateOn vouched for); a ``Prefetching`` record's gate vouched for
what the pod served when claimed, its ``previousVersion``, on containers not recorded. Other
states carry none: their gate is False, or was set
by someone else. The next GateOn of ours writes the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Breach", "GateVouch", "breach"]


@dataclass(frozen=True, slots=True)
class GateVouch:
    """What the pod's gate was set True for (module doc)."""

    version: str
    #: The update whose commit the ranks served (``None``: boot weights, no commit names them).
    update_id: str | None = None
    #: The pod's incarnation the gate was set on (``None``: unknown, an older record).
    incarnation: str | None = None

    def to_json(self) -> dict[str, str]:
        data = {"version": self.version, "updateId": self.update_id}
        data["incarnation"] = self.incarnation
        return {k: v for k, v in data.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GateVouch:
        return cls(
            version=str(data["version"]),
            update_id=data.get("updateId"),
            incarnation=data.get("incarnation"),
        )


@dataclass(frozen=True, slots=True)
class Breach:
    """Why a gate no longer vouches for what the pod serves (:func:`breach`)."""

    why: str
    #: What a ready agent vouches for now (attest the gate again for it); ``None``: nothing
    #: answers for the pod, the gate goes off.
    now: GateVouch | None


def breach(
    vouch: GateVouch,
    incarnation: str,
    *,
    reachable: bool,
    ready: bool,
    version: str | None,
    committed_update_id: str | None,
) -> Breach | None:
    """Why ``vouch`` no longer holds for a pod of ``incarnation`` whose agent answered
    (``reachable``) ``ready`` at ``version`` committed by ``committed_update_id``; ``None``
    while it stands (module doc)."""
    if not reachable:
        if vouch.incarnation is None or vouch.incarnation == incarnation:
            return None  # the vouched containers (or unknown ones): their probe guards them
        why = "its containers are not those its gate was set on and its agent does not answer"
        return Breach(why, None)
    if not ready or not version:
        return None
    if version != vouch.version:
        why = f"its agent serves {version}, not {vouch.version}"
    elif committed_update_id not in (None, vouch.update_id):
        why = f"its agent serves {version} committed by {committed_update_id}"
    else:
        return None  # judged for every gate every pass: no vouch built for one that holds
    return Breach(why, GateVouch(version, committed_update_id, incarnation or None))
