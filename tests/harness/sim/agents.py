"""TEST DOUBLE: simulated pods whose agent is the real :class:`~engine_agent.sidecar.agent.Agent`.

Each :class:`SimPod` runs the sidecar's own update state machine (``engine_agent/sidecar/
agent.py``: hold on accept, drain, begin/load/finish on every rank, all-rank agreement, commit,
fail-closed cleanup, recovery and adoption after a restart) over simulated ranks. What is
simulated is below the agent's one vLLM client:

* :class:`SimRank` is ``tests.harness.fake_vllm.FakeRank`` (the real rank weight-state machine of
  ``engine_agent/reload/session.py``) with a load that reads no files;
* :class:`SimVllm` answers the agent's ``VllmClient`` calls in memory. A ``weightroll_load`` waits
  until the scheduler says how it ends (:meth:`SimPod.finish_load`: committed or failed) or the
  virtual clock passes the call's bound (``EngineTimeout``, as the real client after
  ``timeout + RPC_GRACE_SECONDS``); it stays open for ever otherwise (a hanging load).

:class:`SimAgents` is the operator's ``AgentPort`` over those agents, translating as the
sidecar's HTTP layer (``engine_agent/sidecar/app.py``) and the operator's client
(``weightroll_operator/agent_client.py``) do: answers go through the wire format and the
client's own answer check (``agent_client._parse``), 404 is ``None`` or ignored, 409 is
``AgentConflict`` naming the active update, a pod whose agent does not run (booting, deleted,
partitioned) is ``AgentUnavailable``.

Time is virtual (``SimClock``): the agents get it as ``now``/``monotonic``; their guard loop is
started but parked (``watch_interval`` of a million seconds): kubelet's readiness probe
(:meth:`SimPod.probe`) observes the agent instead, every step.

Limitations: no trainer push (the native transfer routes); no manifests (no file I/O); the
agent's store is kept in memory (an agent restarted "with state" gets a copy of it).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from weightroll_operator.agent_client import _parse
from weightroll_operator.errors import (
    AgentConflict,
    AgentNotFound,
    AgentRejected,
    AgentUnavailable,
)
from weightroll_operator.ports import AgentTarget

from engine_agent.protocol import AgentState, DrainMode, SourceSpec, UpdateRequest, UpdateStatus
from engine_agent.sidecar.agent import Agent, SourceRefused, UpdateConflict, UpdateNotFound
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import RPC_GRACE_SECONDS, EngineTimeout, EngineUnavailable
from engine_agent.sidecar.file_update import LOAD
from engine_agent.sidecar.state import Store
from tests.harness.fake_vllm import FakeRank
from tests.harness.sim.cluster import AGENT_PORT, SimClock

__all__ = ["SimAgents", "SimPod", "SimRank", "SimVllm", "source_of"]


def source_of(version: str) -> str:
    """Where a version's files live (one directory per version, as the chart's examples)."""
    return f"/weights/{version}"


class SimRank(FakeRank):
    """A fake rank whose load (and prefetch) reads no files: the bytes are named by the path."""

    def _read(self, body: dict[str, Any]) -> tuple[str, str, int]:
        return "", f"digest:{body['path']}", 1

    def _load(self, body: dict[str, Any]) -> dict[str, Any]:
        from engine_agent.errors import WrongState
        from engine_agent.reload import session

        if not self.ws.in_session:
            raise WrongState(f"no update session is open (engine is {self.state})")
        self.source_digest = f"digest:{body['path']}"
        self.loaded_bytes = 1
        if self.ws.state.value == "open":
            self.ws = session.mark_written(self.ws)
        return self._report("load")


@dataclass
class _PendingLoad:
    future: asyncio.Future[bool]
    deadline: float


class SimVllm:
    """The agent's vLLM client, in memory (duck-typed ``engine.VllmClient``)."""

    def __init__(self, ranks: list[SimRank], boot_version: str, clock: SimClock) -> None:
        self.ranks = ranks
        self.boot_version = boot_version
        self.clock = clock
        self.base_url = "http://127.0.0.1:8000"
        self.up = False
        self.paused = False
        self.weight_version_label = "default"
        self.pending: _PendingLoad | None = None

    def boot(self) -> None:
        """vLLM (re)started: every rank clean at the boot weights, unpaused, label ``default``."""
        self.fail_pending(EngineUnavailable("vLLM restarted"))
        for rank in self.ranks:
            rank.reset(self.boot_version)
        self.paused = False
        self.weight_version_label = "default"
        self.up = True

    def fail_pending(self, error: Exception) -> None:
        if self.pending is not None and not self.pending.future.done():
            self.pending.future.set_exception(error)
        self.pending = None

    def expire(self) -> None:
        """A load past its bound ends as the real client's ``EngineTimeout``."""
        if self.pending is not None and self.clock.monotonic() > self.pending.deadline:
            self.fail_pending(EngineTimeout("weightroll_load timed out"))

    def _check(self) -> None:
        if not self.up:
            raise EngineUnavailable("vLLM is not up")

    async def close(self) -> None:
        return None

    async def world_size(self) -> int:
        self._check()
        return len(self.ranks)

    async def pause(self, mode: DrainMode, timeout: float) -> None:
        self._check()
        self.paused = True

    async def resume(self) -> None:
        self._check()
        self.paused = False

    async def is_paused(self) -> bool:
        self._check()
        return self.paused

    async def weight_version(self) -> str:
        self._check()
        return self.weight_version_label

    async def set_weight_version(self, version: str) -> None:
        self._check()
        self.weight_version_label = version

    async def reset_prefix_cache(self) -> bool:
        self._check()
        return True

    async def collective_rpc(self, method: str, arg: str, timeout: float) -> list[Any]:
        self._check()
        if method == LOAD:
            loop = asyncio.get_running_loop()
            pending = _PendingLoad(
                loop.create_future(), self.clock.monotonic() + timeout + RPC_GRACE_SECONDS
            )
            self.pending = pending
            ok = await pending.future
            if self.pending is pending:
                self.pending = None
            self._check()
            if not ok:
                for rank in self.ranks:
                    rank.fail[LOAD] = "source_unavailable"
                try:
                    return self._all(method, arg)
                finally:
                    for rank in self.ranks:
                        rank.fail.pop(LOAD, None)
        return self._all(method, arg)

    def _all(self, method: str, arg: str) -> list[Any]:
        # through JSON, as the real client receives the ranks' answers
        return json.loads(json.dumps([rank.handle(method, arg) for rank in self.ranks]))


@dataclass
class SimPod:
    """One simulated pod: its ranks, its vLLM, its agent and what kubelet sees of it."""

    name: str
    uid: str
    ip: str
    boot_version: str
    clock: SimClock
    tp: int = 1
    ranks: list[SimRank] = field(init=False)
    vllm: SimVllm = field(init=False)
    agent: Agent | None = None
    #: The container is not ready for a reason outside the rollout (a readiness blip).
    blip: bool = False
    #: The operator cannot reach the agent (a network partition); the pod itself is fine.
    partitioned: bool = False

    def __post_init__(self) -> None:
        self.ranks = [SimRank(tp=i) for i in range(self.tp)]
        self.vllm = SimVllm(self.ranks, self.boot_version, self.clock)

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{AGENT_PORT}"

    def _config(self) -> AgentConfig:
        return AgentConfig(
            observe_ttl=0.0,  # the probe observes every step; the guard loop is parked
            watch_interval=1e6,
            # The abort answers at once (callers poll the status, as the operator does): a
            # wait bounded in wall-clock seconds let the machine's load decide whether an
            # aborted update had wound down when the pass read its answer, so one seed could
            # give two outcomes.
            abort_wait=0.0,
            initial_version=self.boot_version,
            initial_source=SourceSpec(uri=source_of(self.boot_version)),
        )

    async def boot(self, store: Store | None = None) -> None:
        """vLLM and the agent start (``store``: the agent's state from before a restart)."""
        self.vllm.boot()
        agent = Agent(
            self._config(),
            client=self.vllm,  # type: ignore[arg-type]
            now=self.clock.now,
            monotonic=self.clock.monotonic,
            sleep=self.clock.sleep,
        )
        if store is not None:
            agent.store = store
        await agent.start()
        for _ in range(100):
            if agent.recovered:
                break
            await asyncio.sleep(0)
        assert agent.recovered, f"the agent of {self.name} did not recover"
        self.agent = agent

    async def stop(self) -> Store | None:
        """The agent's container stops (its running update ends Aborted); return its store."""
        agent, self.agent = self.agent, None
        if agent is None:
            return None
        await agent.stop()
        return agent.store

    async def restart(self, *, keep_state: bool) -> None:
        """The pod's containers restart: vLLM onto its boot weights, the agent with a copy of
        its persisted state (``keep_state``) or none."""
        store = await self.stop()
        self.vllm.fail_pending(EngineUnavailable("vLLM stopped"))
        await self.boot(copy.deepcopy(store) if keep_state else None)

    async def restart_vllm(self) -> None:
        """vLLM alone restarts under the running agent, onto its boot weights."""
        self.vllm.boot()
        await asyncio.sleep(0)

    def finish_load(self, ok: bool) -> bool:
        """End the load the agent waits for; whether one was waiting."""
        pending = self.vllm.pending
        if pending is None or pending.future.done():
            return False
        pending.future.set_result(ok)
        return True

    @property
    def loading(self) -> bool:
        return self.vllm.pending is not None and not self.vllm.pending.future.done()

    async def probe(self) -> bool:
        """Kubelet's view of the containers: vLLM up, no blip, the agent's ``/readyz`` 200."""
        if self.agent is None or not self.vllm.up or self.blip:
            return False
        return (await self.agent.readiness()).ready

    def serving(self) -> tuple[frozenset[str], frozenset[str | None], bool]:
        """What the ranks hold: their versions, the commits that produced them, all clean."""
        return (
            frozenset(r.version for r in self.ranks),
            frozenset(r.committed_by for r in self.ranks),
            all(r.state == "clean" for r in self.ranks),
        )


class SimAgents:
    """The operator's ``AgentPort`` over the simulated pods' agents (see the module docstring)."""

    def __init__(self, pods: Mapping[str, SimPod]) -> None:
        self.pods = pods
        self.calls: dict[str, int] = {}
        #: Whether the operator process has stopped mid-pass (crash, or the Lease fence):
        #: nothing it would still call leaves it.
        self.stopped: Callable[[], bool] = lambda: False

    def _agent(self, target: AgentTarget, call: str) -> Agent:
        if self.stopped():
            raise AgentUnavailable(f"{target.pod}: {call}: the operator process stopped")
        self.calls[call] = self.calls.get(call, 0) + 1
        pod = self.pods.get(target.pod)
        if pod is None or pod.agent is None or pod.partitioned or pod.url != target.base_url:
            raise AgentUnavailable(f"{target.pod}: {call}: connection refused")
        return pod.agent

    async def state(self, target: AgentTarget) -> AgentState:
        agent = self._agent(target, "state")
        return _parse(AgentState, (await agent.state()).to_wire(), target)

    async def get_update(self, target: AgentTarget, update_id: str) -> UpdateStatus | None:
        agent = self._agent(target, "get_update")
        try:
            record = agent.get(update_id)
        except UpdateNotFound:
            return None
        return _parse(UpdateStatus, record.to_status().to_wire(), target)

    async def start_update(self, target: AgentTarget, request: UpdateRequest) -> None:
        agent = self._agent(target, "start_update")
        try:
            agent.submit(UpdateRequest.model_validate(request.to_wire()))
        except SourceRefused as e:
            raise AgentRejected(f"{target.pod}: {e}", status=422) from None
        except UpdateConflict as e:
            raise AgentConflict(f"{target.pod}: {e}", status=409, active_id=e.active_id) from None
        await asyncio.sleep(0)  # the update task takes its first steps, as it would meanwhile

    async def swap_update(self, target: AgentTarget, update_id: str) -> None:
        agent = self._agent(target, "swap_update")
        try:
            agent.swap(update_id)
        except UpdateNotFound:
            raise AgentNotFound(f"{target.pod}: no update {update_id!r}", status=404) from None
        except UpdateConflict as e:
            raise AgentConflict(f"{target.pod}: {e}", status=409) from None
        await asyncio.sleep(0)  # the parked update takes its first steps

    async def abort_update(self, target: AgentTarget, update_id: str) -> None:
        agent = self._agent(target, "abort_update")
        try:
            await agent.abort(update_id)
        except UpdateNotFound:
            return
        except UpdateConflict as e:
            raise AgentConflict(f"{target.pod}: {e}", status=409) from None
