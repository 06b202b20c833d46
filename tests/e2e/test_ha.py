"""Two operator replicas with leader election on the real API server (issue 11 finding 6, F).

Cheap pods (``tests.harness.fake_agent_process``, updates of about 3 s) under the pod
simulator, as in ``test_light_fleet.py``. Two ``weightroll-operator --leader-elect`` processes
run as the chart's ServiceAccount (the chart's Role grants the Lease); the leader is killed with
SIGKILL while a unit is in flight. The standby takes the Lease once it expired and finishes the
rollout. A sampler watches the pods all along (``ReadySampler``): never more than
``maxUnavailable`` pods out of traffic at once, every pod drained exactly once (no double
drain), every pod verified at the new version at the end (no unit lost).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
from weightroll_dev.devcluster.apiserver import free_ports
from weightroll_dev.devcluster.operator_process import launch_operator, log_tail, stop_process

from tests.e2e.conftest import NAMESPACE, ReadySampler, _operator_kubeconfig
from tests.e2e.test_light_fleet import Light, _phase, _pod, _weightupdate, chart, light

__all__ = ["chart", "light"]

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

PODS = tuple(f"p-{i}" for i in range(4))
#: Short, so the standby takes over quickly; not shorter: the holder must renew within 2/3 of
#: it (main.py), and etcd's fsync or the holder's event loop can stall for seconds on 2 loaded
#: cores — at 6 s (4 s to renew) a slow renewal made the leader step down mid-test.
LEASE_SECONDS = 10


def _replica(light: Light, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = _operator_kubeconfig(light.cluster, light.run / f"kubeconfig-{name}")
    log = light.run / f"operator-{name}.log"
    env = {
        "POD_NAME": name,
        "POD_NAMESPACE": NAMESPACE,
        "WEIGHTROLL_LEASE_NAME": "weightroll-operator",
        "WEIGHTROLL_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    args = (f"--namespace={light.ns}", "--leader-elect")
    proc = launch_operator(cfg, log, free_ports(1)[0], *args, env=env)
    return proc, log


def _wait_log(proc: subprocess.Popen[bytes], log: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text(errors="replace"):
        assert proc.poll() is None, log_tail(log)
        assert time.monotonic() < deadline, f"no {needle!r}: {log_tail(log)}"
        time.sleep(0.2)


def _in_flight(light: Light) -> bool:
    out = light.kubectl("get", "wu", "wu", "-o", "json", check=False)
    replicas = (json.loads(out).get("status") or {}).get("replicas") or {} if out else {}
    return int(replicas.get("verified", 0)) >= 1 and int(replicas.get("draining", 0)) >= 1


def test_leader_killed_mid_rollout_the_standby_finishes_it(light: Light) -> None:
    for name in PODS:
        pod = _pod(name)
        pod["spec"]["containers"][0]["args"].append("--step=1")  # an update takes about 3 s
        light.apply(pod)
    for name in PODS:
        light.wait(name, ContainersReady="True")
    first, first_log = _replica(light, "op-a")
    second: subprocess.Popen[bytes] | None = None
    try:
        _wait_log(first, first_log, "Acquired the leader Lease", 60)
        for name in PODS:  # admitted on their boot weights by the leader
            light.wait(name, Ready="True", timeout=60)
        second, second_log = _replica(light, "op-b")
        _wait_log(second, second_log, "Waiting for the leader Lease", 60)
        # a watch, not a poll: a 3 s drain cannot fall between two slow reads
        with ReadySampler(light.cluster.kubeconfig, light.ns, PODS) as sampled:
            light.apply(_weightupdate(light.ns, "wu", "v2"))
            deadline = time.monotonic() + 120
            while not _in_flight(light):
                assert time.monotonic() < deadline, log_tail(first_log)
                time.sleep(0.2)
            first.send_signal(signal.SIGKILL)
            first.wait(10)
            _wait_log(second, second_log, "Acquired the leader Lease", 4 * LEASE_SECONDS + 30)
            deadline = time.monotonic() + 180
            while _phase(light, "wu") != "Succeeded":
                assert second.poll() is None, log_tail(second_log)
                assert time.monotonic() < deadline, log_tail(second_log)
                time.sleep(0.5)
            for name in PODS:
                light.wait(name, Ready="True", timeout=60)
            time.sleep(1)  # the settled fleet a little longer: a late second drain is seen
    finally:
        for proc in (first, second):
            if proc is not None:
                stop_process(proc)
        light.kubectl("delete", "wu", "wu", "--wait=false", check=False)
    status = json.loads(light.kubectl("get", "wu", "wu", "-o", "json"))["status"]
    assert status["replicas"]["verified"] == len(PODS), status
    assert sampled.most_out <= 1, ("more than maxUnavailable out of traffic", sampled.worst)
    assert sampled.drains == dict.fromkeys(PODS, 1), sampled.drains
    assert "Lost the leader Lease" not in second_log.read_text()
