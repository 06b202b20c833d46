"""End to end on the real kube-apiserver: a rollout with ``strategy.prefetch.mode: Host``
(issue 30, acceptance 2).

Each pod reads and verifies the new checkpoint while it serves (weight-state ``Prefetching``),
and is drained only once its prefetch verified. Judged from the pods as the API server holds
them (a watch: every change, in order), not from the operator's bookkeeping:

* every pod was seen ``Prefetching`` with ``Ready`` True: it stayed in traffic for its read;
* a pod out of traffic (``Ready`` not True) was always claimed for the drain (``Draining``), or
  had its gate back on already (kubelet not caught up): out only from its drain to its
  verdict, never for its prefetch;
* ``status.pods[].step`` moved forward through ``Prefetching``/``Prefetched`` ... ``Ready``.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.e2e.conftest import GATE, NAMESPACE, PODS, Fleet, ReadySampler

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.server,
    pytest.mark.timeout(1200),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

#: The order of ``status.pods[].step`` (issue 30 item 3).
STEPS = ("Prefetching", "Prefetched", "Draining", "Swapping", "Verifying", "Ready")


class StateSampler(ReadySampler):
    """A :class:`ReadySampler` that also keeps, per pod, every (weight-state, Ready, gate)
    seen, in the API server's order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history: dict[str, list[tuple[str, str | None, str | None]]] = {}
        #: When each entry of :attr:`history` was seen (monotonic seconds).
        self.stamps: dict[str, list[float]] = {}

    def seconds(self, pod: str, until: float, pick: Any) -> float:
        """Seconds ``pod`` spent in entries ``pick(state, ready, gate)`` selects."""
        trail, stamps = self.history.get(pod, []), self.stamps.get(pod, [])
        ends = [*stamps[1:], until]
        return sum(
            end - start for seen, start, end in zip(trail, stamps, ends, strict=True) if pick(*seen)
        )

    def _observe(self, *pods: dict[str, Any]) -> None:
        super()._observe(*pods)
        with self._lock:
            for pod in pods:
                name = pod["metadata"]["name"]
                if name not in self.ready:
                    continue
                annotations = pod["metadata"].get("annotations") or {}
                raw = annotations.get("weightroll.io/weight-state")
                state = json.loads(raw).get("state", "") if raw else ""
                seen = (state, self.ready[name], self.gates[name])
                trail = self.history.setdefault(name, [])
                if not trail or trail[-1] != seen:
                    trail.append(seen)
                    self.stamps.setdefault(name, []).append(time.monotonic())


class StepPoller:
    """Polls ``status.pods[].step`` of one WeightUpdate in a thread: each pod's steps in the
    order seen (a step shorter than the poll may be missed; the order of those seen holds)."""

    def __init__(self, fleet: Fleet, name: str) -> None:
        self.fleet, self.name = fleet, name
        self.steps: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-poll", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                body = self.fleet.weightupdate(self.name)
            except Exception:  # not created yet, or a slow kubectl: ask again
                body = {}
            for entry in (body.get("status") or {}).get("pods") or []:
                step = entry.get("step")
                trail = self.steps.setdefault(entry["name"], [])
                if step and (not trail or trail[-1] != step):
                    trail.append(step)
            self._stop.wait(0.3)

    def __enter__(self) -> StepPoller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_prefetched_rollout_keeps_each_pod_in_traffic_for_its_read(fleet: Fleet) -> None:
    name = "to-v2-prefetched"
    sampler = StateSampler(fleet.info.kubeconfig, NAMESPACE, PODS)
    with sampler, StepPoller(fleet, name) as poller:
        fleet.apply_weightupdate(name, "v2", prefetch={"mode": "Host", "maxConcurrent": 1})
        status = fleet.wait_phase(name, "Succeeded", "Failed", timeout=600)
        fleet.wait_pods("Ready", "True", PODS, timeout=60)
        time.sleep(1.0)  # the last status write and Ready events reach the poll and watch
    steps = poller.steps
    until = time.monotonic()
    for pod in PODS:  # figures for the closing note (logged with the fleet's timings)
        fleet.timings[f"{pod}_out_of_traffic_s"] = sampler.seconds(
            pod, until, lambda state, ready, gate: ready != "True"
        )
        fleet.timings[f"{pod}_prefetching_in_traffic_s"] = sampler.seconds(
            pod, until, lambda state, ready, gate: state == "Prefetching" and ready == "True"
        )
    print("prefetched rollout timings:", {k: round(v, 2) for k, v in fleet.timings.items()})
    history = sampler.history
    context = f"\nstatus: {status}\nhistory: {history}\nsteps: {steps}"

    assert status["phase"] == "Succeeded", context
    assert sampler.most_out == 1, (sampler.most_out, sampler.worst)
    for pod in PODS:
        trail = history.get(pod, [])
        # in traffic while it read: weight-state Prefetching with Ready (and the gate) True
        assert ("Prefetching", "True", "True") in trail, f"{pod}{context}"
        # out of traffic only once claimed for the drain, until its gate is back on
        for state, ready, gate in trail:
            if ready != "True":
                assert state == "Draining" or gate == "True", f"{pod}: {state}{context}"
        assert sampler.drains[pod] == 1, f"{pod} drained {sampler.drains[pod]} times{context}"
        assert fleet.condition(pod, GATE) == "True"
        assert fleet.agent_state(pod)["version"] == "v2"
        # the steps the status showed moved forward only, and ended Ready
        seen = steps.get(pod, [])
        assert seen and seen[-1] == "Ready", f"{pod}{context}"
        order = [STEPS.index(step) for step in seen]
        assert order == sorted(order), f"{pod}: {seen}{context}"
    shown = {step for trail in steps.values() for step in trail}
    assert shown & {"Prefetching", "Prefetched"}, context
