"""Operator scale benchmark (issue 4 acceptance 4): prints one JSON object.

A simulated fleet of N pods (default 1,000) at v1 is rolled to v2 with ``maxUnavailable`` 10 %
by the operator's real :class:`~weightroll_operator.reconcile.Reconciler` (planner, apply,
status), driven like kopf's timer. The Kubernetes API and the agents are in-memory doubles of
the two ports (``weightroll_operator.ports``): the API merges pod conditions by type and plays
kubelet (Ready = every readiness gate True); each agent commits ``T`` seconds after it is asked.

Reported: reconcile pass time (p50/p95/max), API writes per pod (by kind), total rollout time
versus the ideal ``ceil(N / maxUnavailable) * T``, and whether each goal of the issue is met
(at most 1.1 x ideal, 100 ms per pass, 6 API writes per pod).

Usage: ``python bench/operator_scale.py [--pods 1000] [--update-seconds 2] [--interval 0.02]``
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from weightroll_operator.api.v1alpha1 import resolve_max_unavailable
from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY
from weightroll_operator.ports import AgentTarget
from weightroll_operator.reconcile import Reconciler

from engine_agent.protocol import (
    AgentState,
    EngineState,
    SourceSpec,
    UpdatePhase,
    UpdateRequest,
    UpdateStatus,
    Verdict,
)

NS = "bench"


class MemKube:
    """In-memory Kubernetes API: the calls of ``KubePort``, counted.

    Every write replaces the pod object (copy on write), as a watch / the kopf index delivers a
    new object per change; the operator relies on that to reuse views of unchanged pods.
    """

    def _fresh(self, name: str) -> dict[str, Any]:
        pod = copy.deepcopy(self.pods[name])
        self.pods[name] = pod
        return pod

    def __init__(self, pods: dict[str, dict[str, Any]], wu: dict[str, Any]) -> None:
        self.pods, self.wu = pods, wu
        self.writes: Counter[str] = Counter()

    async def patch_pod_condition(
        self,
        namespace: str,
        name: str,
        condition: Mapping[str, Any],
        *,
        resource_version: str | None = None,
    ) -> None:
        self.writes["pod-status"] += 1
        status = self._fresh(name)["status"]
        conds = {c["type"]: c for c in status["conditions"]}
        conds[condition["type"]] = dict(condition)
        ready = conds[CONDITION_WEIGHTS_READY]["status"] == "True"
        conds["Ready"] = {"type": "Ready", "status": "True" if ready else "False"}
        status["conditions"] = list(conds.values())

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        annotations: Mapping[str, str | None] | None = None,
        labels: Mapping[str, str | None] | None = None,
    ) -> None:
        self.writes["pod-metadata"] += 1
        meta = self._fresh(name)["metadata"]
        for key, values in (("annotations", annotations), ("labels", labels)):
            for k, v in (values or {}).items():
                if v is None:
                    meta[key].pop(k, None)
                else:
                    meta[key][k] = v

    async def patch_weightupdate_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> None:
        self.writes["wu-status"] += 1
        status = self.wu.setdefault("status", {})
        for k, v in patch.items():
            if v is None:
                status.pop(k, None)
            else:
                status[k] = v

    async def read_agent_token(self, namespace: str, name: str, key: str) -> str:
        return "token"

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        self.writes["event"] += 1


class MemAgents:
    """In-memory agents: an update commits ``seconds`` after it is started."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.version: dict[str, str] = {}
        self.updates: dict[str, tuple[UpdateRequest, float]] = {}
        self.calls: Counter[str] = Counter()

    def _status(self, pod: str, uid: str) -> UpdateStatus | None:
        entry = self.updates.get(f"{pod}/{uid}")
        if entry is None:
            return None
        req, done_at = entry
        done = time.monotonic() >= done_at
        if done:
            self.version[pod] = req.version
        return UpdateStatus(
            id=req.id,
            version=req.version,
            mode=req.mode,
            phase=UpdatePhase.COMMITTED if done else UpdatePhase.LOADING,
            verdict=Verdict(committed=True) if done else None,
        )

    async def state(self, target: AgentTarget) -> AgentState:
        self.calls["state"] += 1
        version = self.version.setdefault(target.pod, "v1")
        return AgentState(
            version=version,
            engine_state=EngineState.CLEAN,
            ready=True,
            paused=False,
            source=SourceSpec(uri=f"/weights/{version}"),
        )

    async def get_update(self, target: AgentTarget, update_id: str) -> UpdateStatus | None:
        self.calls["get_update"] += 1
        return self._status(target.pod, update_id)

    async def start_update(self, target: AgentTarget, request: UpdateRequest) -> None:
        self.calls["start_update"] += 1
        key = f"{target.pod}/{request.id}"
        self.updates.setdefault(key, (request, time.monotonic() + self.seconds))

    async def abort_update(self, target: AgentTarget, update_id: str) -> None:
        self.calls["abort_update"] += 1


def make_fleet(n: int) -> dict[str, dict[str, Any]]:
    pods = {}
    for i in range(n):
        name = f"vllm-{i:05d}"
        pods[name] = {
            "metadata": {
                "name": name,
                "namespace": NS,
                "uid": f"uid-{i}",
                "labels": {"app": "llm"},
                "annotations": {},
            },
            "spec": {
                "readinessGates": [{"conditionType": CONDITION_WEIGHTS_READY}],
                "containers": [
                    {"name": "agent", "ports": [{"name": "weightroll", "containerPort": 8470}]}
                ],
            },
            "status": {
                "podIP": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": CONDITION_WEIGHTS_READY, "status": "True"},
                ],
                "containerStatuses": [{"restartCount": 0}],
            },
        }
    return pods


async def run(pods_n: int, seconds: float, interval: float, max_unavailable: str) -> dict[str, Any]:
    pods = make_fleet(pods_n)
    wu: dict[str, Any] = {
        "metadata": {"name": "bench", "namespace": NS, "generation": 1},
        "spec": {
            "selector": {"matchLabels": {"app": "llm"}},
            "version": "v2",
            "source": {"uri": "/weights/v2"},
            "strategy": {"maxUnavailable": max_unavailable, "progressDeadlineSeconds": 3600},
        },
    }
    kube, agents = MemKube(pods, wu), MemAgents(seconds)
    rec = Reconciler(kube=kube, agents=agents, state_ttl=3600.0, concurrency=256)
    pass_ms: list[float] = []
    start = time.monotonic()
    phase = ""
    while phase != "Succeeded":
        t0 = time.perf_counter()
        result = await rec.reconcile(wu, pods.values())
        pass_ms.append((time.perf_counter() - t0) * 1000)
        phase = result.phase.value
        if result.errors:
            raise RuntimeError(f"apply errors: {result.errors[:3]}")
        if time.monotonic() - start > 50 * seconds + 60:
            raise RuntimeError(f"rollout stuck in {phase}: {wu.get('status', {}).get('message')}")
        await asyncio.sleep(interval)
    total = time.monotonic() - start
    batch = resolve_max_unavailable(max_unavailable, pods_n)
    ideal = math.ceil(pods_n / batch) * seconds
    writes = sum(kube.writes.values())
    p95 = statistics.quantiles(pass_ms, n=20)[-1] if len(pass_ms) >= 20 else max(pass_ms)
    pod_writes = kube.writes["pod-status"] + kube.writes["pod-metadata"] + kube.writes["event"]
    return {
        "pods": pods_n,
        "maxUnavailable": max_unavailable,
        "batch": batch,
        "updateSeconds": seconds,
        "timerIntervalSeconds": interval,
        "passes": len(pass_ms),
        "passMs": {
            "p50": round(statistics.median(pass_ms), 2),
            "p95": round(p95, 2),
            "max": round(max(pass_ms), 2),
            "first": round(pass_ms[0], 2),
        },
        "apiWrites": dict(kube.writes),
        "apiWritesPerPod": round(writes / pods_n, 3),
        "podWritesPerPod": round(pod_writes / pods_n, 3),
        "agentCalls": dict(agents.calls),
        "totalSeconds": round(total, 2),
        "idealSeconds": ideal,
        "ratioToIdeal": round(total / ideal, 3),
        "goals": {
            "ratioToIdeal<=1.1": total / ideal <= 1.1,
            "passMsP95<=100": p95 <= 100,
            "apiWritesPerPod<=6": writes / pods_n <= 6,
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pods", type=int, default=1000)
    p.add_argument("--update-seconds", type=float, default=2.0, help="simulated T per unit")
    p.add_argument("--interval", type=float, default=0.02, help="timer interval (seconds)")
    p.add_argument("--max-unavailable", default="10%")
    args = p.parse_args(argv)
    report = asyncio.run(run(args.pods, args.update_seconds, args.interval, args.max_unavailable))
    json.dump(report, sys.stdout, indent=2)
    print()
    return 0 if all(report["goals"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
