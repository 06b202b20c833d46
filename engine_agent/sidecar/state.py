"""Update records and the agent's durable memory (idempotent by update id).

The agent keeps one :class:`UpdateRecord` per update id it accepted, plus a few facts that cannot
be re-derived from the ranks: the version it expects them to serve, where those weights came
from, and the *hold* — the reason the replica must stay paused, set by any failed or aborted
update or by a fault found later, and cleared only by a committed update.

Persistence is optional: with a state directory (an ``emptyDir`` in the pod) the store is written
atomically after every change, so an agent restarted inside the same pod can say why its last
update ended ("agent restarted during Loading") instead of forgetting it. Without one, the agent
still re-derives the engine state from the ranks at start-up; it only loses the history.

Writers: only the agent and its feeders (``agent``, ``file_update``, ``pipeline``, ``push``)
mutate the store; the HTTP layer reads snapshots.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from pydantic import ValidationError

from engine_agent.protocol import (
    RankReport,
    SourceSpec,
    UpdateMode,
    UpdatePhase,
    UpdateRequest,
    UpdateStatus,
    Verdict,
)

__all__ = ["STATE_FILE", "AgentMemory", "Store", "UpdateRecord"]

logger = logging.getLogger(__name__)

#: File name inside the state directory.
STATE_FILE: Final = "agent-state.json"
#: Finished records kept (oldest dropped first); the active one is never dropped.
MAX_RECORDS: Final = 64


@dataclass(slots=True)
class UpdateRecord:
    """Everything the agent knows about one update; rendered as :class:`UpdateStatus`."""

    request: UpdateRequest
    phase: UpdatePhase = UpdatePhase.PENDING
    #: Latest report of each rank (finish overrides load overrides begin).
    ranks: list[RankReport] = field(default_factory=list)
    verdict: Verdict | None = None
    #: Seconds per phase: drain, begin, load, finish, verify, resume, total.
    timings: dict[str, float] = field(default_factory=dict)
    started_at: str | None = None
    finished_at: str | None = None
    message: str = ""

    @property
    def id(self) -> str:
        return self.request.id

    def to_status(self) -> UpdateStatus:
        return UpdateStatus(
            id=self.request.id,
            version=self.request.version,
            mode=self.request.mode,
            phase=self.phase,
            ranks=list(self.ranks),
            verdict=self.verdict,
            timings=dict(self.timings),
            started_at=self.started_at,
            finished_at=self.finished_at,
            message=self.message,
        )

    def to_json(self) -> dict[str, Any]:
        return {"request": self.request.to_wire(), "status": self.to_status().to_wire()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> UpdateRecord:
        status = UpdateStatus.model_validate(data["status"])
        return cls(
            request=UpdateRequest.model_validate(data["request"]),
            phase=status.phase,
            ranks=list(status.ranks),
            verdict=status.verdict,
            timings=dict(status.timings),
            started_at=status.started_at,
            finished_at=status.finished_at,
            message=status.message,
        )


@dataclass(slots=True)
class AgentMemory:
    """Facts that the ranks cannot tell a restarted agent."""

    #: Version the ranks must serve for the replica to be ready (``None``: adopt what they say).
    expected_version: str | None = None
    #: Source of the weights of ``expected_version`` (``None`` when unknown).
    source: SourceSpec | None = None
    #: Why generation must stay paused; ``None`` when nothing holds the replica.
    hold: str | None = None
    #: Problem code of the hold (metric label).
    hold_code: str | None = None
    #: Id of the update or trainer push that committed ``expected_version`` (``None``: boot
    #: weights, or adopted after a restart without state).
    committed_update_id: str | None = None

    def commit(self, version: str, update_id: str, source: SourceSpec | None) -> None:
        """Every rank committed ``version`` by ``update_id``: the version, its source and the
        commit's id change together, and the hold is cleared.

        One method for both commit paths (file updates and trainer pushes), so no commit can
        leave the id of an earlier one standing: ``/v1/state`` attributes the weights the ranks
        serve to this id, and the operator gates a pod on only for its own attempt's id.
        """
        self.expected_version = version
        self.source = source
        self.committed_update_id = update_id
        self.hold = self.hold_code = None

    def delta_refusal(self, request: UpdateRequest) -> str | None:
        """Why a partial or sparse ``request`` may not build on what this memory holds (None: it
        may): a delta applies to the exact files of the version the agent accepted."""
        if request.mode is UpdateMode.FULL:
            return None
        what = f"a {request.mode.value} update builds on the version this agent accepted"
        if self.hold is not None:
            return f"{what}, but the replica is held ({self.hold}); send a full update"
        if self.expected_version is None:
            return f"{what}, and it has accepted none; send a full update"
        if self.source is None:
            # A trainer push (or a commit adopted after a restart without state) may carry any
            # label: a delta computed against the checkpoint of that label would be applied to
            # other bytes.
            return (
                f"{what} ({self.expected_version}), but the files it serves are unknown "
                "(pushed by a trainer, or adopted after an agent restart); send a full update"
            )
        if request.base_version != self.expected_version:
            return (
                f"{what} ({self.expected_version}), but its baseVersion is {request.base_version}"
            )
        return None


class Store:
    """Records by id plus :class:`AgentMemory`, optionally persisted to ``state_dir``."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.state_dir = state_dir
        self.records: dict[str, UpdateRecord] = {}
        self.memory = AgentMemory()
        #: Id of the update that runs now; at most one.
        self.active_id: str | None = None

    @property
    def active(self) -> UpdateRecord | None:
        return None if self.active_id is None else self.records.get(self.active_id)

    def add(self, record: UpdateRecord) -> None:
        self.records[record.id] = record
        finished = [r for r in self.records.values() if r.phase.terminal]
        for old in finished[: max(0, len(self.records) - MAX_RECORDS)]:
            del self.records[old.id]

    def save(self) -> None:
        """Write the store atomically (no-op without a state directory; never raises)."""
        if self.state_dir is None:
            return
        document = {
            "records": [record.to_json() for record in self.records.values()],
            "activeId": self.active_id,
            "expectedVersion": self.memory.expected_version,
            "source": None if self.memory.source is None else self.memory.source.to_wire(),
            "hold": self.memory.hold,
            "holdCode": self.memory.hold_code,
            "committedUpdateId": self.memory.committed_update_id,
        }
        path = self.state_dir / STATE_FILE
        tmp = path.with_name(f".{STATE_FILE}.tmp")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(document))
            os.replace(tmp, path)
        except OSError as e:
            logger.error("Failed to persist agent state to %s: %s", path, e)

    def load(self) -> bool:
        """Read a persisted store; return whether one was found (a corrupt one is ignored)."""
        if self.state_dir is None:
            return False
        path = self.state_dir / STATE_FILE
        try:
            document = json.loads(path.read_text())
            records = [UpdateRecord.from_json(item) for item in document["records"]]
            source = document.get("source")
            memory = AgentMemory(
                expected_version=document.get("expectedVersion"),
                source=None if source is None else SourceSpec.model_validate(source),
                hold=document.get("hold"),
                hold_code=document.get("holdCode"),
                committed_update_id=document.get("committedUpdateId"),
            )
            active_id = document.get("activeId")
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError, ValidationError) as e:
            logger.error("Ignored unreadable agent state %s: %s", path, e)
            return False
        self.records = {record.id: record for record in records}
        self.memory = memory
        self.active_id = active_id if active_id in self.records else None
        return True
