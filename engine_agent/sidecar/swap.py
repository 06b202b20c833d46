"""A prefetched update's park and go: when ``POST /v1/updates/{id}/swap`` is the go, and which
ranks have not finished reading.

With ``prefetch.mode: Host`` every rank reads the checkpoint into host staging while the replica
serves; the update is ``Prefetched`` once every rank reports ``ready``
(:func:`prefetch_waiting` names the others). With ``prefetch.awaitSwap`` it parks there until
the operator gives the go (:func:`swap_refusal` says when that is refused). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from engine_agent.protocol import RankReport, UpdatePhase
from engine_agent.sidecar.state import UpdateRecord

__all__ = ["prefetch_waiting", "swap_refusal"]


def prefetch_waiting(reports: Sequence[RankReport]) -> list[str]:
    """The ranks whose prefetch is not ``ready`` yet (their keys, sorted)."""
    return sorted(report.rank.key for report in reports if report.prefetch != "ready")


#: Phases in which a swap was given (or is being acted on): a repeated swap is acknowledged.
_SWAPPING: Final = frozenset(
    {
        UpdatePhase.PREFETCHED,
        UpdatePhase.DRAINING,
        UpdatePhase.LOADING,
        UpdatePhase.VERIFYING,
        UpdatePhase.COMMITTED,
    }
)


def swap_refusal(record: UpdateRecord) -> str | None:
    """Why ``POST /v1/updates/{id}/swap`` is refused for ``record`` (None: it is the go, or a
    repeat of it). Only an update that awaits its swap can be swapped, and only once it is
    ``Prefetched``; past that the swap is idempotent."""
    prefetch = record.request.prefetch
    if not prefetch.await_swap:
        return (
            f"update {record.id!r} does not wait for a swap (prefetch.awaitSwap is false); "
            f"it is in phase {record.phase.value}"
        )
    if record.phase not in _SWAPPING:
        return f"update {record.id!r} is in phase {record.phase.value}, not Prefetched"
    return None
