"""Drives the operator's reconciler against kmock + simulated agents, pass by pass.

The tier runs on virtual time (looptime, marked in ``conftest.py``): every sleep, backoff,
interval and timeout of the operator, kopf and the simulated agents moves the event loop's clock
instead of waiting, and the cluster clock (:meth:`Harness.now`) follows that clock.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Iterable
from datetime import datetime, timedelta
from typing import Any

import aiohttp
import kopf
from weightroll_operator.agent_client import AgentClient
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
    WeightState,
)
from weightroll_operator.handlers import Runtime, register
from weightroll_operator.k8s.client import KubeApi, KubeConfig
from weightroll_operator.metrics import Metrics
from weightroll_operator.reconcile import PassResult, Reconciler, utcnow
from weightroll_operator.settings import OperatorConfig

from tests.harness.fake_agent import FakeAgent, FakeFleetAgents
from tests.harness.kube_fleet import FleetEmulator, make_pod, make_weightupdate

NS = "default"


class Harness:
    def __init__(self, emulator: FleetEmulator, url: str, agents: FakeFleetAgents) -> None:
        self.emu, self.url, self.agents = emulator, url, agents
        self.emu.agent_snapshot = self._snapshot
        self.http = aiohttp.ClientSession(base_url=url)
        self.kube = KubeApi(KubeConfig(server=url))
        self.client = AgentClient(timeout=1.0)
        self.metrics = Metrics()
        #: How far the operator's clock runs ahead of the event loop's (see :meth:`advance`).
        self.clock_ahead = timedelta(0)
        self._started = utcnow()
        self._elapsed = 0.0
        self._loop_seen: float | None = None
        #: The pause between the passes of :meth:`run_until`, in the loop's time. On virtual
        #: time a pass takes none, so a short pause buys only more passes per agent step (0.02
        #: s by default; three per update), all CPU: 0.05 s cost the tier 1.4x the CPU of the
        #: real clock with its 0.01 s pause; 0.1 s costs the same as the real clock did.
        self.tick_interval = 0.1
        # One cluster clock: the agents' records are stamped on the clock the operator reads,
        # so a unit started after :meth:`advance` is not judged by a clock 'behind' it.
        agents.clock = self.now
        for agent in agents.agents.values():
            agent.clock = self.now
        self.rec = self.new_reconciler()

    def new_reconciler(self, **overrides: Any) -> Reconciler:
        """A fresh operator process: no memory of earlier passes (restart). ``overrides``:
        other arguments of the Reconciler (``state_ttl=30.0``: cached agent answers)."""
        args: dict[str, Any] = {
            "state_ttl": 0.0,
            "agent_backoff": 0.05,
            "agent_backoff_cap": 0.5,
            "clock": self.now,
            "monotonic": self.monotonic,
            **overrides,
        }
        return Reconciler(kube=self.kube, agents=self.client, metrics=self.metrics, **args)

    def monotonic(self) -> float:
        """Seconds the event loop's clock has run since the harness began (the operator's
        monotonic clock: TTLs, backoffs, write expectations). Never steps back: looptime moves
        the loop onto virtual time only for the test's body, after the fixture that made this
        harness ran on the real one, and that switch is not time passing."""
        try:
            loop_now = asyncio.get_running_loop().time()
        except RuntimeError:  # called outside the loop: no time has run since the last call
            return self._elapsed
        if self._loop_seen is not None and loop_now > self._loop_seen:
            self._elapsed += loop_now - self._loop_seen
        self._loop_seen = loop_now
        return self._elapsed

    def now(self) -> datetime:
        """The cluster clock (operator and agents): the wall clock when the harness began, run
        on by the event loop's time (virtual in this tier) and moved ahead by :meth:`advance`."""
        return self._started + timedelta(seconds=self.monotonic()) + self.clock_ahead

    def advance(self, seconds: float) -> None:
        """Move the operator's clock ahead, so a deadline passes without the test sleeping
        (and without racing a slow machine: a short wall-clock deadline can pass before the
        step it is meant to bound was even sent)."""
        self.clock_ahead += timedelta(seconds=seconds)

    def _snapshot(self, pod: str) -> dict[str, Any] | None:
        agent = self.agents.agents.get(pod)
        return None if agent is None else agent.snapshot()

    async def close(self) -> None:
        await self.http.close()
        await self.kube.close()
        await self.client.close()
        await self.agents.close()

    # ---- objects -------------------------------------------------------------------------------

    async def _post(self, path: str, body: dict[str, Any]) -> None:
        async with self.http.post(path, json=body) as resp:
            assert resp.status < 400, await resp.text()

    async def add_pods(
        self, n: int, start: int = 0, gate: bool | None = True, **agent_kw: Any
    ) -> list[FakeAgent]:
        created = []
        for i in range(start, start + n):
            name = f"pod-{i}"
            agent = await self.agents.add(name, i, **agent_kw)
            pod = make_pod(name, agent.host, self.agents.port, gate=gate)
            await self._post(f"/api/v1/namespaces/{NS}/pods", pod)
            created.append(agent)
        if start > 0:
            return created
        await self._post(
            f"/api/v1/namespaces/{NS}/secrets",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {
                    "name": "agent-token",
                    "namespace": NS,
                    "labels": {"weightroll.io/agent-token": "true"},
                },
                "data": {"token": base64.b64encode(b"s3cret").decode()},
            },
        )
        return created

    async def create_pod(self, body: dict[str, Any]) -> None:
        await self._post(f"/api/v1/namespaces/{NS}/pods", body)

    async def create_wu(self, name: str, version: str, **kw: Any) -> None:
        kw.setdefault("agent", {"tokenSecretRef": {"name": "agent-token"}})
        body = make_weightupdate(name, version, **kw)
        await self._post(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}", body)

    async def patch_wu(self, name: str, spec: dict[str, Any]) -> None:
        path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/{name}"
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.http.patch(path, json={"spec": spec}, headers=headers) as resp:
            assert resp.status < 400

    async def delete_wu(self, name: str) -> None:
        path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/{name}"
        async with self.http.delete(path) as resp:
            assert resp.status < 400

    async def delete_pod(self, name: str) -> None:
        async with self.http.delete(f"/api/v1/namespaces/{NS}/pods/{name}") as resp:
            assert resp.status < 400

    async def wu(self, name: str) -> dict[str, Any]:
        body: dict[str, Any] = await self.kube.get_weightupdate(NS, name)
        return body

    async def status(self, name: str) -> dict[str, Any]:
        return dict((await self.wu(name)).get("status") or {})

    async def pods(self) -> list[dict[str, Any]]:
        return await self.kube.list_pods(NS)

    async def pod(self, name: str) -> dict[str, Any]:
        return next(p for p in await self.pods() if p["metadata"]["name"] == name)

    # ---- passes --------------------------------------------------------------------------------

    async def tick(self, name: str, rec: Reconciler | None = None) -> PassResult:
        peers = await self.kube.list_weightupdates(NS)
        return await (rec or self.rec).reconcile(await self.wu(name), await self.pods(), peers)

    async def run_until(
        self,
        names: Iterable[str],
        done: Any,
        *,
        timeout: float = 15.0,
        rec: Reconciler | None = None,
    ) -> None:
        """Tick every named WeightUpdate until ``await done()`` is true; fail after ``timeout``
        seconds of the loop's (virtual) time."""
        names = list(names)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for name in names:
                await self.tick(name, rec)
            if await done():
                return
            assert loop.time() < deadline, "timed out waiting: " + str(
                [await self.status(n) for n in names]
            )
            await asyncio.sleep(self.tick_interval)

    def phase_is(self, name: str, *phases: str) -> Any:
        async def check() -> bool:
            return (await self.status(name)).get("phase") in phases

        return check

    # ---- assertions ----------------------------------------------------------------------------

    def assert_never_ready_unverified(self, allowed_versions: set[str]) -> None:
        """Every write that set the gate True happened while the pod's agent was committed,
        not paused, and serving one of ``allowed_versions``."""
        trues = [w for w in self.emu.status_writes if w.gate() == "True"]
        for w in trues:
            assert w.agent is not None, w
            assert w.agent["ready"], f"{w.pod} marked ready while its agent was {w.agent}"
            assert w.agent["version"] in allowed_versions, (w.pod, w.agent)
        for w in self.emu.status_writes:
            types = {c["type"] for c in w.conditions}
            assert types == {CONDITION_WEIGHTS_READY}, f"wrote {types} on {w.pod}"

    def max_drained_at_once(self) -> int:
        drained: set[str] = set()
        worst = 0
        for w in self.emu.status_writes:
            if w.gate() == "False":
                drained.add(w.pod)
            elif w.gate() == "True":
                drained.discard(w.pod)
            worst = max(worst, len(drained))
        return worst

    async def gate(self, pod: str) -> str | None:
        for c in (await self.pod(pod))["status"]["conditions"]:
            if c["type"] == CONDITION_WEIGHTS_READY:
                return str(c["status"])
        return None

    async def state_of(self, pod: str) -> WeightState | None:
        raw = (await self.pod(pod))["metadata"].get("annotations", {}).get(ANNOTATION_WEIGHT_STATE)
        return WeightState.from_json(raw) if raw else None

    async def owner_of(self, pod: str) -> str | None:
        owner = (await self.pod(pod))["metadata"].get("annotations", {}).get(ANNOTATION_OWNER)
        return str(owner) if owner else None

    def condition(self, status: dict[str, Any], ctype: str) -> dict[str, Any]:
        return next(c for c in status.get("conditions", []) if c["type"] == ctype)


async def wait_until(predicate: Any, timeout: float = 20, what: str = "timed out") -> Any:
    """Poll ``await predicate()`` every 0.05 s of the loop's (virtual) time until it returns
    something truthy, and return that; fail with ``what`` after ``timeout`` seconds of it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (got := await predicate()):
        assert loop.time() < deadline, what
        await asyncio.sleep(0.05)
    return got


@contextlib.asynccontextmanager
async def running_operator(h: Harness, **config: Any) -> AsyncIterator[None]:
    """The whole operator (kopf handlers, indices, timer) on ``h``'s reconciler, against kmock.

    Read what a test needs while it runs: kmock stalls on reads after kopf's watch streams are
    cut at shutdown.
    """
    registry = kopf.OperatorRegistry()
    register(registry, Runtime(reconciler=h.rec, config=OperatorConfig(interval=0.1, **config)))

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=h.url, insecure=True)

    stop = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(registry=registry, clusterwide=True, standalone=True, stop_flag=stop)
    )
    try:
        yield
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=10)
