"""The replica's one commit sequence (engine_agent/sidecar/pipeline.py), which both feeders run.

Each rule is checked on the pipeline alone, against a recording stand-in for the vLLM client:
one owner at a time whichever feeder asks; a failure saves its hold *before* the feeder's session
close runs and leaves generation paused whatever the close did; only a confirmed commit clears
the hold, names the version and resumes, in that order. The feeders' own paths over real HTTP
are tests/contract/agent (file updates) and tests/contract/agent/test_trainer_client.py,
tests/unit/engine_agent/test_transfer_watchdog.py (pushes).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from engine_agent.protocol import DrainMode, SourceSpec, UpdatePhase, UpdateRequest
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineTimeout, EngineUnavailable, VllmClient
from engine_agent.sidecar.metrics import AgentMetrics
from engine_agent.sidecar.pipeline import UNACCEPTED_PREFIX, Pipeline, ReplicaBusy
from engine_agent.sidecar.rounds import Problem
from engine_agent.sidecar.state import Store, UpdateRecord

ATTEMPT = "u-7"


def rank(
    tp: int, state: str = "clean", update_id: str | None = ATTEMPT, version: str = "v2"
) -> dict[str, Any]:
    return {
        "rank": {"dp": 0, "pp": 0, "tp": tp, "ep": 0},
        "state": state,
        "version": version,
        "updateId": update_id,
        "committedUpdateId": update_id,
        "servingSafe": state == "clean",
    }


@dataclass
class RecordingVllm:
    """Records every call in order; ``ranks`` is what ``weightroll_state`` answers."""

    ranks: list[dict[str, Any]] = field(default_factory=lambda: [rank(0), rank(1)])
    paused: bool = False
    unreachable: bool = False
    cache_resets_refused: int = 0
    wait_times_out: bool = False
    calls: list[str] = field(default_factory=list)

    def _reach(self, call: str) -> None:
        self.calls.append(call)
        if self.unreachable:
            raise EngineUnavailable(f"{call}: vLLM unreachable (connection refused)")

    async def collective_rpc(self, method: str, arg: str, timeout: float) -> list[Any]:
        self._reach(str(method))
        return list(self.ranks)

    async def is_paused(self) -> bool:
        self._reach("is_paused")
        return self.paused

    async def pause(self, mode: DrainMode, timeout: float) -> None:
        self._reach(f"pause:{mode.value}")
        if mode is DrainMode.WAIT and self.wait_times_out:
            raise EngineTimeout("pause: timed out")
        self.paused = True

    async def resume(self) -> None:
        self._reach("resume")
        self.paused = False

    async def set_weight_version(self, version: str) -> None:
        self._reach(f"version:{version}")

    async def reset_prefix_cache(self) -> bool:
        self._reach("reset_prefix_cache")
        if self.cache_resets_refused > 0:
            self.cache_resets_refused -= 1
            return False
        return True


def pipeline_on(vllm: RecordingVllm) -> tuple[Pipeline, list[int]]:
    forgotten: list[int] = []
    pipeline = Pipeline(
        AgentConfig(),
        cast(VllmClient, vllm),
        Store(),
        AgentMetrics(),
        lambda: forgotten.append(1),
    )
    return pipeline, forgotten


def running_record(phase: UpdatePhase) -> UpdateRecord:
    request = UpdateRequest.model_validate({"id": "u-1", "version": "v2", "source": {"uri": "/w"}})
    return UpdateRecord(request=request, started_at="2026-12-06T00:00:00Z", phase=phase)


# -- one owner -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "record_phase", "refused_naming"),
    [
        (None, None, None),  # free
        ("trainer push push-1 in progress", None, "push-1"),  # a push owns it
        (None, UpdatePhase.LOADING, "u-1 in progress (phase Loading)"),  # a file update runs
        (None, UpdatePhase.FAILED, None),  # a finished record owns nothing
    ],
)
def test_one_attempt_owns_the_replica_whichever_feeder_asks(
    owner: str | None, record_phase: UpdatePhase | None, refused_naming: str | None
) -> None:
    pipeline, _ = pipeline_on(RecordingVllm())
    if owner is not None:
        pipeline.claim(owner)
    if record_phase is not None:
        record = running_record(record_phase)
        pipeline.store.add(record)
        pipeline.store.active_id = record.id
    if refused_naming is None:
        pipeline.claim("update u-2")
        assert pipeline.busy and pipeline.owner == "update u-2"
        return
    with pytest.raises(ReplicaBusy, match=refused_naming.replace("(", r"\(").replace(")", r"\)")):
        pipeline.claim("update u-2")
    assert pipeline.busy


def test_release_frees_the_replica_and_forgets_what_was_seen() -> None:
    pipeline, forgotten = pipeline_on(RecordingVllm())
    pipeline.claim("push", watchdog=None)
    pipeline.release()
    assert not pipeline.busy and pipeline.watchdog is None and forgotten
    pipeline.claim("update u-2")  # the next one may start


# -- drain -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "timeout", "wait_times_out", "said", "calls"),
    [
        (DrainMode.WAIT, 30.0, False, "wait", ["pause:wait"]),
        (DrainMode.WAIT, 30.0, True, "abort after timeout", ["pause:wait", "pause:abort"]),
        (DrainMode.WAIT, 0.0, False, "abort", ["pause:abort"]),
        (DrainMode.ABORT, 30.0, False, "abort", ["pause:abort"]),
    ],
)
@pytest.mark.asyncio
async def test_drain_waits_then_aborts_what_is_left(
    mode: DrainMode, timeout: float, wait_times_out: bool, said: str, calls: list[str]
) -> None:
    vllm = RecordingVllm(wait_times_out=wait_times_out)
    pipeline, _ = pipeline_on(vllm)
    assert await pipeline.drain(mode, timeout) == said
    assert vllm.calls == calls and vllm.paused


# -- confirm and commit ------------------------------------------------------------------------


async def no_problem() -> list[Problem]:
    return []


async def manifest_changed() -> list[Problem]:
    return [Problem("manifest_changed", "re-published")]


@pytest.mark.parametrize(
    ("ranks", "refusals", "checks", "codes", "reset_called"),
    [
        ([rank(0), rank(1)], 0, [no_problem], [], True),
        ([rank(0), rank(1)], 2, [], [], True),  # refused twice, accepted on the third try
        ([rank(0), rank(1)], 3, [manifest_changed], ["cache_reset_failed"], True),
        ([rank(0), rank(1)], 0, [manifest_changed], ["manifest_changed"], True),
        # a rank not at this attempt: nothing else is asked
        ([rank(0), rank(1, update_id="u-6")], 0, [manifest_changed], None, False),
        ([rank(0)], 0, [], None, False),  # a rank missing
    ],
)
@pytest.mark.asyncio
async def test_confirm_checks_state_then_cache_then_the_feeders_checks(
    ranks: list[dict[str, Any]],
    refusals: int,
    checks: list[Any],
    codes: list[str] | None,
    reset_called: bool,
) -> None:
    vllm = RecordingVllm(ranks=ranks, cache_resets_refused=refusals)
    pipeline, _ = pipeline_on(vllm)
    problems = await pipeline.confirm(2, ATTEMPT, "v2", checks)
    if codes is None:
        assert problems  # whatever the rank rule names; the rest is not asked
        assert "manifest_changed" not in [p.code for p in problems]
    else:
        assert [p.code for p in problems] == codes
    assert ("reset_prefix_cache" in vllm.calls) is reset_called


@pytest.mark.asyncio
async def test_commit_names_the_version_clears_the_hold_then_resumes() -> None:
    vllm = RecordingVllm(paused=True)
    pipeline, _ = pipeline_on(vllm)
    await pipeline.mark_unaccepted(ATTEMPT)
    pipeline.hold(Problem("update_incomplete", "started"))
    source = SourceSpec.model_validate({"uri": "/w/v2"})
    await pipeline.commit("v2", ATTEMPT, source)
    assert vllm.calls == [f"version:{UNACCEPTED_PREFIX}{ATTEMPT}", "version:v2", "resume"]
    memory = pipeline.store.memory
    assert memory.hold is None and memory.expected_version == "v2"
    assert memory.committed_update_id == ATTEMPT and memory.source == source


# -- failure -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("paused", "unreachable", "close_says", "pauses"),
    [
        (True, False, [], []),  # drained already: stays paused
        (False, False, [], ["pause:abort"]),  # failed before the drain: paused now
        (False, False, [Problem("fence_failed", "rank 1")], ["pause:abort"]),
        (False, True, [], []),  # vLLM gone: nothing to pause, the hold is saved
    ],
)
@pytest.mark.asyncio
async def test_a_failure_is_held_before_the_session_closes_and_stays_paused(
    paused: bool, unreachable: bool, close_says: list[Problem], pauses: list[str]
) -> None:
    vllm = RecordingVllm(paused=paused, unreachable=unreachable)
    pipeline, _ = pipeline_on(vllm)
    held_when_closing: list[str | None] = []

    async def close(first: Problem) -> list[Problem]:
        held_when_closing.append(pipeline.store.memory.hold)
        return list(close_says)

    problems = [Problem("digest_mismatch", "rank 0 read another checkpoint")]
    await pipeline.fail(f"update {ATTEMPT}", problems, close)
    memory = pipeline.store.memory
    assert held_when_closing == [memory.hold]  # saved before the close ran
    assert memory.hold_code == "digest_mismatch" and ATTEMPT in (memory.hold or "")
    assert problems[1:] == close_says  # what closing found is reported too
    assert [c for c in vllm.calls if c.startswith("pause")] == pauses
    assert "resume" not in vllm.calls


@pytest.mark.asyncio
async def test_a_close_that_raises_still_leaves_the_replica_held_and_paused() -> None:
    vllm = RecordingVllm(paused=False)
    pipeline, _ = pipeline_on(vllm)

    async def close(first: Problem) -> list[Problem]:
        raise RuntimeError("defect in a feeder's close")

    with pytest.raises(RuntimeError):
        await pipeline.fail("push p-1", [Problem("shape_mismatch", "q_proj")], close)
    assert pipeline.store.memory.hold_code == "shape_mismatch" and vllm.paused


# -- admission ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_an_update_cancelled_before_its_first_step_ends_aborted_and_frees_the_replica() -> (
    None
):
    """asyncio never runs a task cancelled before its first step, so the feeder's own cleanup
    cannot end it: the record would stay Pending and the replica claimed for ever."""
    from engine_agent.sidecar.agent import Agent

    agent = Agent(AgentConfig(), client=cast(VllmClient, RecordingVllm()))
    agent._recovered.set()
    request = UpdateRequest.model_validate({"id": "u-1", "version": "v2", "source": {"uri": "/w"}})
    created, record = agent.submit(request)
    assert created and agent.pipeline.busy
    task = agent._task
    assert task is not None
    task.cancel()  # before the loop ran it once
    with pytest.raises(asyncio.CancelledError):
        await task
    assert record.phase is UpdatePhase.ABORTED and not agent.pipeline.busy
    assert agent.pipeline.owner is None
