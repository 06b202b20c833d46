"""Which other WeightUpdates hold the fleet (pure).

Per pod, the ``weightroll.io/owner`` annotation says which WeightUpdate drives it right now. That
alone leaves gaps between units (a pod is released before the next one is claimed), so a second
WeightUpdate could slip in mid-rollout and the two would interleave. Fleet-level rule: a
WeightUpdate does not start units while another *active* one (Progressing, Paused, RollingBack)
that started earlier selects any of the same pods. Ties (same start time) go to the smaller name.

Limitations:
    * Start times have one-second resolution; two rollouts started in the same second are
      ordered by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from weightroll_operator.api.v1alpha1 import Phase, parse_spec
from weightroll_operator.domain.fleet import matches
from weightroll_operator.domain.model import OwnerKey, PodView, owner_key

__all__ = ["ACTIVE_PHASES", "blocking_peers"]

ACTIVE_PHASES = frozenset({Phase.PROGRESSING.value, Phase.PAUSED.value, Phase.ROLLING_BACK.value})


def blocking_peers(
    owner: OwnerKey,
    my_start: str | None,
    pods: tuple[PodView, ...],
    peers: Iterable[Mapping[str, Any]],
) -> tuple[str, ...]:
    """Owner keys of the active WeightUpdates that have precedence over ``owner`` on its pods."""
    result = []
    for peer in peers:
        meta = peer.get("metadata") or {}
        key = owner_key(str(meta.get("namespace")), str(meta.get("name")))
        status = peer.get("status") or {}
        if key == owner or status.get("phase") not in ACTIVE_PHASES:
            continue
        start = status.get("startTime")
        if not start:
            continue
        if my_start is not None and (start, key) >= (my_start, owner):
            continue
        try:
            spec = parse_spec(peer.get("spec"))
        except ValueError:
            continue
        if any(matches(spec.selector, p.labels) for p in pods):
            result.append(str(key))
    return tuple(sorted(result))
