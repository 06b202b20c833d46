"""A finished rollout converges new pods, on the real kube-apiserver (issue 27 items 1 and 7).

With default settings a WeightUpdate ``Succeeded`` longer than ``progressDeadlineSeconds`` ago
halted with ``ProgressDeadlineExceeded`` on the first pass that saw a new pod (its agent not up
yet: no progress that pass), the pod never served, and with ``onFailure: Rollback`` the whole
fleet rolled back. A scale-up pod whose update failed rolled the finished fleet back too.

The rollout here is the default one but for a short deadline (20 s, so the test waits past it
in seconds rather than 30 minutes; the mechanism is the same) and ``onFailure: Rollback``. Cheap
pods (``tests.harness.fake_agent_process``) under the pod simulator and the chart's
ServiceAccount, as in ``test_light_fleet.py``, whose fixtures this module reuses.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from weightroll_dev.devcluster.operator_process import stop_process

from tests.e2e import test_light_fleet as lf
from tests.e2e.test_light_fleet import Light, _phase, _pod, _start_operator, _weightupdate

#: The fixtures of ``test_light_fleet.py`` (the chart, a namespace with the pod simulator).
chart = lf.chart
light = lf.light

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

DEADLINE = 20


def _status(light: Light, name: str) -> dict[str, Any]:
    out = light.kubectl("get", "wu", name, "-o", "json")
    status: dict[str, Any] = json.loads(out).get("status") or {}
    return status


def _state(light: Light, pod: str) -> dict[str, Any]:
    raw = light.pod(pod)["metadata"].get("annotations", {}).get("weightroll.io/weight-state")
    return json.loads(raw) if raw else {}


def test_new_pods_after_success_converge_and_a_failing_one_is_reported(light: Light) -> None:
    for i in range(2):
        light.apply(_pod(f"p-{i}"))
    for i in range(2):
        light.wait(f"p-{i}", ContainersReady="True")
    proc, log = _start_operator(light, "finished")
    phases: list[str | None] = []
    try:
        wu = _weightupdate(light.ns, "wu", "v2")
        wu["spec"]["strategy"] |= {
            "updateTimeoutSeconds": 15,
            "progressDeadlineSeconds": DEADLINE,
            "onFailure": "Rollback",
        }
        light.apply(wu)
        deadline = time.monotonic() + 240
        while _phase(light, "wu") != "Succeeded":
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(DEADLINE + 5)  # Succeeded longer than progressDeadlineSeconds ago
        # a scale-up: one pod that loads v2, one whose agent fails every v2 update
        light.apply(_pod("p-2"))
        light.apply(_pod("p-3", fail=("v2",)))
        deadline = time.monotonic() + 180
        while True:
            status = _status(light, "wu")
            phases.append(status.get("phase"))
            results = {p["name"]: p for p in status.get("pods") or []}
            done = (
                light.conditions("p-2").get("Ready") == "True"
                and results.get("p-3", {}).get("state") == "Failed"
            )
            if done:
                break
            assert status.get("phase") not in ("Failed", "RollingBack", "RolledBack"), (
                status,
                log.read_text()[-3000:],
            )
            assert time.monotonic() < deadline, (status, log.read_text()[-3000:])
            time.sleep(0.5)
        for _ in range(6):  # a few more passes: nothing halts or rolls back afterwards
            time.sleep(0.5)
            phases.append(_phase(light, "wu"))
        status = _status(light, "wu")
        assert status["phase"] == "Succeeded", status
        assert "abortedAt" not in status or status["abortedAt"] is None, status
        assert not {"Failed", "RollingBack", "RolledBack"} & set(filter(None, phases)), phases
        degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
        assert degraded["status"] == "True" and "p-3" in degraded["message"], degraded
        for name in ("p-0", "p-1", "p-2"):
            assert light.conditions(name)["Ready"] == "True", name
            st = _state(light, name)
            assert (st.get("state"), st.get("version")) == ("Verified", "v2"), (name, st)
        assert light.conditions("p-3")["Ready"] == "False"  # kept out of traffic
        assert _state(light, "p-3").get("state") == "Failed"
        light.kubectl("delete", "wu", "wu", "--timeout=60s")
    finally:
        stop_process(proc)
