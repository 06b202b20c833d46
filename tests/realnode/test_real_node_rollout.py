"""The chart, the operator and vLLM pods on the real node (``dev up --node real``), and a rollout
judged from the EndpointSlices the real controller-manager writes.

Two vLLM CPU pods with the agent sidecar (BestEffort: the machine has 2 cores): the real
scheduler places them, the real kubelet runs their probes and reports Ready only once the
operator set the ``weightroll.io/weights-ready`` gate. Then a WeightUpdate v1 -> v2 must reach
``Succeeded`` while, in every sample of the Service's EndpointSlices
(:mod:`weightroll_dev.realnode.sampler`), at most ``maxUnavailable`` selected pods are out of
the ready endpoints and no ready endpoint's agent reports anything but v1 or v2, ready and not
inside an update. Root, the node binaries and vLLM needed; otherwise skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from weightroll_dev import checkout_pythonpath
from weightroll_dev.realnode import devcluster, missing_prerequisites
from weightroll_dev.realnode.config import POD_SUBNET
from weightroll_dev.realnode.node import in_netns
from weightroll_dev.realnode.sampler import budget_breaches, violations

MISSING = missing_prerequisites()
if importlib.util.find_spec("vllm") is None:
    MISSING.append("vLLM in the virtualenv")
pytestmark = [
    pytest.mark.realnode,
    pytest.mark.skipif(bool(MISSING), reason="real node needs: " + "; ".join(MISSING)),
]

GATE = "weightroll.io/weights-ready"
SERVICE = "vllm-example"
PODS = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("real-dev")
    try:
        yield devcluster.up(directory, PODS, say=lambda line: print(line, flush=True))
    finally:
        problems = devcluster.down(directory)
        assert not problems, problems


def kubectl(cluster: dict[str, Any], *args: str, input_: str | None = None) -> str:
    proc = subprocess.run(
        in_netns(cluster["netns"], ["kubectl", f"--kubeconfig={cluster['kubeconfig']}", *args]),
        input=input_, capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, f"kubectl {args}: {proc.stderr}"
    return proc.stdout


def selected_pods(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    selector = ",".join(f"{k}={v}" for k, v in cluster["selector"].items())
    out = kubectl(cluster, "get", "pods", "-n", cluster["namespace"], "-l", selector, "-o", "json")
    return list(json.loads(out)["items"])


def condition(pod: dict[str, Any], kind: str) -> str | None:
    found = [c["status"] for c in pod["status"].get("conditions", []) if c["type"] == kind]
    return found[0] if found else None


def test_pods_are_made_ready_by_the_kubelet_through_the_gate(cluster: dict[str, Any]) -> None:
    pods = selected_pods(cluster)
    assert len(pods) == PODS
    for pod in pods:
        assert pod["spec"]["nodeName"] == "weightroll-node"  # placed by the real scheduler
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
        assert pod["spec"]["readinessGates"] == [{"conditionType": GATE}]
        assert condition(pod, GATE) == "True"  # the operator's write
        assert condition(pod, "ContainersReady") == "True"  # the kubelet's probes
        assert condition(pod, "Ready") == "True"  # the kubelet's verdict of both
        names = {c["name"]: c["ready"] for c in pod["status"]["containerStatuses"]}
        assert names == {"vllm": True, "weightroll-agent": True}


def test_rollout_keeps_the_budget_and_no_unverified_endpoint(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    namespace = cluster["namespace"]
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": namespace},
        "spec": {"selector": cluster["selector"], "ports": [{"port": 8000, "targetPort": 8000}]},
    }
    kubectl(cluster, "apply", "-f", "-", input_=json.dumps(service))
    token = tmp_path / "token"
    token.write_text(cluster["agentToken"])
    samples = tmp_path / "samples.jsonl"
    selector = ",".join(f"{k}={v}" for k, v in cluster["selector"].items())
    argv = [sys.executable, "-m", "weightroll_dev.realnode.sampler",
            f"--kubeconfig={cluster['kubeconfig']}", f"--namespace={namespace}",
            f"--selector={selector}", f"--service={SERVICE}", f"--token-file={token}",
            f"--out={samples}"]  # fmt: skip
    sampler = subprocess.Popen(
        in_netns(cluster["netns"], argv), env={**os.environ, "PYTHONPATH": checkout_pythonpath()}
    )
    try:
        # The Service's slice must show both pods ready before the rollout starts.
        deadline = time.monotonic() + 60
        while not _ready_in_last_sample(samples, PODS):
            assert time.monotonic() < deadline, "the EndpointSlice never showed both pods ready"
            assert sampler.poll() is None, "the sampler exited"
            time.sleep(1)
        update = {
            "apiVersion": "weightroll.io/v1alpha1",
            "kind": "WeightUpdate",
            "metadata": {"name": "to-v2", "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": cluster["selector"]},
                "version": "v2",
                "source": dict(cluster["checkpoints"]["v2"]),
                "strategy": {
                    "maxUnavailable": 1,
                    "onFailure": "Halt",
                    "updateTimeoutSeconds": 300,
                    "drain": {"mode": "wait", "timeoutSeconds": 10},
                },
                "agent": {"tokenSecretRef": {"name": cluster["tokenSecret"]}},
            },
        }
        kubectl(cluster, "apply", "-f", "-", input_=json.dumps(update))
        deadline = time.monotonic() + 600
        phase = ""
        while phase != "Succeeded":
            if phase in ("Failed", "Halted"):
                pytest.fail(kubectl(cluster, "get", "weightupdate", "to-v2", "-n", namespace,
                                    "-o", "yaml"))  # fmt: skip
            assert time.monotonic() < deadline, f"WeightUpdate still {phase!r}"
            time.sleep(2)
            got = kubectl(cluster, "get", "weightupdate", "to-v2", "-n", namespace, "-o", "json")
            phase = json.loads(got).get("status", {}).get("phase", "")
        # Both pods back as ready endpoints on v2 (the sampler sees the end state too).
        deadline = time.monotonic() + 60
        while not _ready_in_last_sample(samples, PODS, version="v2"):
            assert time.monotonic() < deadline, "the pods never came back as v2 endpoints"
            time.sleep(1)
    finally:
        sampler.send_signal(signal.SIGTERM)
        sampler.wait(30)
    rounds = [json.loads(line) for line in samples.read_text().splitlines()]
    good = [r for r in rounds if "error" not in r]
    assert len(good) >= 10, f"only {len(good)} samples"
    budget = [b for r in good for b in budget_breaches(r, max_unavailable=1)]
    unverified = [v for r in good for v in violations(r, accepted=("v1", "v2"))]
    assert not budget, budget[:5]
    assert not unverified, unverified[:5]
    # The rollout was observed: a pod out of the endpoints while it updated, and v2 at the end.
    assert any(not all(r["endpoints"].values()) or len(r["endpoints"]) < PODS for r in good)


def _ready_in_last_sample(samples: Path, count: int, version: str | None = None) -> bool:
    if not samples.exists():
        return False
    lines = samples.read_text().splitlines()
    if not lines:
        return False
    last = json.loads(lines[-1])
    if "error" in last or sum(last["endpoints"].values()) != count:
        return False
    if version is None:
        return True
    return all((s or {}).get("version") == version for s in last["agents_after"].values())
