"""The agent ends a trainer push nobody can finish any more (issue 12: a replica must never stay
held, refusing every later update, by a push whose trainer died or whose vLLM restarted).

The coordinator runs against a recording stand-in for the vLLM client: the ranks' answers are
scripted, so each way a push can die is one table row. The same path on a real engine (vLLM
killed and restarted mid-push) is ``test_vllm_restarted_mid_push`` in
``tests/server/test_trainer_tp1.py``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from engine_agent.sidecar.agent import Agent
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineUnavailable, VllmClient
from engine_agent.sidecar.push import FENCE, Push, PushFailed, TransferCoordinator

PUSH = "push-1-abcdef01"
IDLE_TIMEOUT = 60.0


def rank_status(tp: int, state: str, update_id: str | None) -> dict[str, Any]:
    return {
        "rank": {"dp": 0, "pp": 0, "tp": tp, "ep": 0},
        "state": state,
        "version": "v0",
        "updateId": update_id,
        "servingSafe": state == "clean",
    }


def fence_report(tp: int, fenced: bool) -> dict[str, Any]:
    """A rank's answer to the fence (its ``weightroll_abort`` report): poisoned, or refused."""
    return {
        "rank": {"dp": 0, "pp": 0, "tp": tp, "ep": 0},
        "call": "abort",
        "ok": fenced,
        "state": "poisoned" if fenced else "clean",
        "version": "v0",
        "error": None if fenced else {"code": "internal", "message": "no transfer backend"},
    }


@dataclass
class ScriptedVllm:
    """Answers the calls the coordinator makes; ``ranks`` is what ``weightroll_state`` says."""

    ranks: list[dict[str, Any]] | None
    fence_error: Exception | None = None
    #: tp ranks that refuse the fence (answer ``ok: false``, not poisoned).
    unfenced: set[int] = field(default_factory=set)
    calls: list[str] = field(default_factory=list)
    paused: bool = True
    #: ``world_size`` waits for this event when set (a slow vLLM).
    world_gate: asyncio.Event | None = None

    async def collective_rpc(self, method: str, arg: str, timeout: float) -> list[Any]:
        self.calls.append(method)
        if method == FENCE and self.fence_error is not None:
            raise self.fence_error
        if self.ranks is None:
            raise EngineUnavailable("collective_rpc: vLLM unreachable (connection refused)")
        if method == FENCE:
            return [fence_report(tp, tp not in self.unfenced) for tp in range(len(self.ranks))]
        return list(self.ranks)

    async def world_size(self) -> int:
        if self.world_gate is not None:
            await self.world_gate.wait()
        return len(self.ranks or [])

    async def is_paused(self) -> bool:
        return self.paused

    async def pause(self, mode: Any, timeout: float) -> None:
        self.paused = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def open_push(vllm: ScriptedVllm, *, world: int = 2) -> tuple[TransferCoordinator, Clock]:
    clock = Clock()
    config = AgentConfig(push_idle_timeout=IDLE_TIMEOUT)
    agent = Agent(config, client=cast(VllmClient, vllm), monotonic=clock)
    coordinator = TransferCoordinator(agent, monotonic=clock)
    coordinator.push = Push(PUSH, world, clock.now, clock.now)
    agent.pipeline.claim(f"trainer push {PUSH} is in progress", coordinator.watch)
    agent.store.memory.hold = f"push_incomplete: push {PUSH} started and has not committed"
    return coordinator, clock


OPEN = [rank_status(0, "open", PUSH), rank_status(1, "open", PUSH)]
MIXED = [rank_status(0, "dirty", PUSH), rank_status(1, "open", PUSH)]
RESTARTED = [rank_status(0, "clean", None), rank_status(1, "clean", None)]
ONE_RESTARTED = [rank_status(0, "dirty", PUSH), rank_status(1, "clean", None)]
FENCED = [rank_status(0, "poisoned", PUSH), rank_status(1, "poisoned", PUSH)]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("ranks", "idle_s", "ended_as"),
    [
        (OPEN, 0.0, None),  # alive: the trainer is between two steps
        (MIXED, 30.0, None),  # dirty and open ranks mid-push are normal
        (None, 30.0, None),  # vLLM unreachable: it may be restarting, look again later
        (RESTARTED, 0.0, "engine_restarted"),  # the ranks lost the session
        (ONE_RESTARTED, 0.0, "engine_restarted"),
        (FENCED, 0.0, "engine_restarted"),  # the session was closed underneath the push
        (OPEN, IDLE_TIMEOUT + 1, "push_abandoned"),  # the trainer went silent
        (None, IDLE_TIMEOUT + 1, "push_abandoned"),  # ... even while vLLM is down
    ],
)
async def test_watchdog_ends_only_a_dead_push(
    ranks: list[dict[str, Any]] | None, idle_s: float, ended_as: str | None
) -> None:
    vllm = ScriptedVllm(ranks)
    coordinator, clock = open_push(vllm)
    agent = coordinator.agent
    clock.now += idle_s
    await coordinator.watch()
    if ended_as is None:
        assert coordinator.push is not None and agent.pipeline.owner is not None
        assert FENCE not in vllm.calls
        return
    assert coordinator.push is None and agent.pipeline.owner is None  # the next push may start
    assert FENCE in vllm.calls  # whatever the ranks hold can never commit
    hold = agent.store.memory.hold or ""
    assert agent.store.memory.hold_code == ended_as and PUSH in hold  # still out of traffic
    assert coordinator.last_failure is not None and ended_as in coordinator.last_failure


@pytest.mark.asyncio
async def test_watchdog_leaves_a_step_in_flight_alone() -> None:
    vllm = ScriptedVllm(RESTARTED)
    coordinator, clock = open_push(vllm)
    clock.now += IDLE_TIMEOUT + 1
    async with coordinator.lock:  # a step holds the lock: it ends the push itself
        await coordinator.watch()
    assert coordinator.push is not None and vllm.calls == []


@pytest.mark.asyncio
async def test_a_fence_that_breaks_unexpectedly_still_releases_the_push() -> None:
    vllm = ScriptedVllm(RESTARTED, fence_error=RuntimeError("socket closed"))
    coordinator, _ = open_push(vllm)
    await coordinator.watch()
    assert coordinator.push is None and coordinator.agent.pipeline.owner is None
    assert coordinator.agent.store.memory.hold_code == "engine_restarted"
    assert coordinator.last_failure is not None and "fence_failed" in coordinator.last_failure


@pytest.mark.asyncio
async def test_a_rank_the_fence_did_not_poison_is_named() -> None:
    """A 200 from vLLM is not every rank fenced (found by review: its answers were not read)."""
    vllm = ScriptedVllm(RESTARTED, unfenced={1})
    coordinator, _ = open_push(vllm)
    await coordinator.watch()
    assert coordinator.push is None
    failure = coordinator.last_failure or ""
    assert "fence_failed" in failure and "dp0:pp0:tp1:ep0" in failure, failure
    assert "tp0:ep0'] are not" not in failure  # the rank that was fenced is not named
    assert coordinator.agent.store.memory.hold is not None


@pytest.mark.asyncio
async def test_a_push_starting_refuses_a_file_update_before_its_first_await() -> None:
    """Found by review: ``start`` claimed the agent only after asking vLLM its world size, so a
    file update accepted meanwhile ran beside the push (its commit resumed generation)."""
    from engine_agent.protocol import UpdateRequest
    from engine_agent.sidecar.agent import UpdateConflict

    vllm = ScriptedVllm(RESTARTED, world_gate=asyncio.Event())
    trainers = (ipaddress.ip_network("127.0.0.1/32"),)  # pushes are refused without any
    agent = Agent(AgentConfig(trainer_networks=trainers), client=cast(VllmClient, vllm))
    agent._recovered.set()
    coordinator = TransferCoordinator(agent)
    starting = asyncio.create_task(coordinator.start())
    await asyncio.sleep(0)  # start() now waits for the world size
    request = UpdateRequest.model_validate(
        {"id": "u-1", "version": "v2", "source": {"uri": "/w/v2"}}
    )
    with pytest.raises(UpdateConflict, match="trainer push"):
        await agent.submit(request)
    with pytest.raises(PushFailed, match="conflict"):
        await coordinator.start()  # nor a second push
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert agent.pipeline.owner is None and coordinator.push is None  # nothing left claimed


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("raised", "status", "code"),
    [
        (EngineUnavailable("POST /update_weights: vLLM unreachable"), 503, "engine_unavailable"),
        (KeyError("rank"), 500, "internal_error"),
    ],
)
async def test_any_failing_step_ends_the_push_fenced(
    raised: Exception, status: int, code: str
) -> None:
    vllm = ScriptedVllm(OPEN)
    coordinator, _ = open_push(vllm)
    push = coordinator.push
    assert push is not None
    with pytest.raises(PushFailed) as failed:
        async with coordinator._failing_closed(push):
            raise raised
    assert failed.value.problems[0].code == code
    assert failed.value.status == status
    assert coordinator.push is None and FENCE in vllm.calls
    assert coordinator.agent.store.memory.hold_code == code


@pytest.mark.asyncio
async def test_a_cancelled_step_releases_the_push_and_keeps_the_hold() -> None:
    vllm = ScriptedVllm(OPEN)
    coordinator, _ = open_push(vllm)
    push = coordinator.push
    assert push is not None

    async def step() -> None:
        async with coordinator._failing_closed(push):
            await asyncio.Event().wait()

    task = asyncio.create_task(step())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert coordinator.push is None and coordinator.agent.pipeline.owner is None
    hold = coordinator.agent.store.memory.hold or ""
    assert "push_incomplete" in hold  # the replica stays out of traffic


def test_the_agent_flag_sets_the_idle_timeout() -> None:
    from engine_agent.sidecar.main import build_config, parse_args

    args = parse_args(["--push-idle-timeout", "42", "--vllm-url", "http://127.0.0.1:1"])
    assert build_config(args).push_idle_timeout == 42.0
    assert json.dumps(AgentConfig().push_idle_timeout) == "900.0"
