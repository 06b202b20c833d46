"""How a file update ends: its verdict recorded, and what closing its ranks' session asks.

Every way an update ends — committed, failed, aborted, interrupted by an agent restart, or
cancelled before it ran — is recorded the same way (:func:`finish_record`): phase, verdict,
stamp, the outcome counted, the update no longer active. A failed one closes its ranks' session
with ``weightroll_abort`` (:func:`abort_args`), poisoning every rank once any may have written.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from engine_agent.protocol import EngineState, UpdatePhase, Verdict
from engine_agent.sidecar.metrics import AgentMetrics
from engine_agent.sidecar.rounds import Problem
from engine_agent.sidecar.state import Store, UpdateRecord

__all__ = ["abort_args", "finish_record"]


def abort_args(record: UpdateRecord, cause: Problem, finish_sent: bool = False) -> str:
    """``weightroll_abort`` argument: fence every rank when any rank may have written.

    A rank whose own call failed before writing returns to clean, but the replica is mixed if
    another rank wrote (or its state is unknown): then every rank must be poisoned, or a later
    partial update would be accepted by the "clean" ranks (docs/contracts.md, replica fence).
    Once ``finish`` was sent, ranks may have committed a version the agent now rejects: always
    poison then.
    """
    written = (
        finish_sent
        or not record.ranks
        or any(report.state in (EngineState.DIRTY, EngineState.POISONED) for report in record.ranks)
    )
    if not written:
        return "{}"
    reason = f"update {record.id} did not commit on every rank: {cause.message}"
    return json.dumps({"poison": True, "reason": reason[:500]})


def finish_record(
    store: Store,
    metrics: AgentMetrics,
    record: UpdateRecord,
    phase: UpdatePhase,
    problems: Sequence[Problem],
    stamp: str,
) -> None:
    """Record ``record``'s verdict (``phase``, ``problems``) and end it as the active update."""
    record.phase = phase
    record.verdict = Verdict(
        committed=phase is UpdatePhase.COMMITTED, reasons=[str(p) for p in problems]
    )
    record.finished_at = stamp
    if problems:
        record.message = str(problems[0])
    outcome = {UpdatePhase.COMMITTED: "committed", UpdatePhase.ABORTED: "aborted"}.get(
        phase, "failed"
    )
    metrics.updates.labels(outcome=outcome).inc()
    if store.active_id == record.id:
        store.active_id = None
    store.save()
