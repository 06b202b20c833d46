"""The real node (weightroll_dev.realnode) end to end: a real kubelet makes a pod Ready by its
probe and restarts its killed container; a readiness gate decides Ready, a failing probe takes
the pod out with the gate True, and the EndpointSlice of a Service follows both; the
checkout's virtualenv runs in a pod through read-only hostPath mounts; and ``down`` leaves
nothing on the host.

Runs as root with the node binaries built (``bash scripts/kube-apiserver.sh build``) and
containerd, runc and the CNI plugins installed (``scripts/system-deps.sh``); otherwise skipped
with the missing pieces named. Never runs vLLM: the pod is the tiny image with the host's /usr.
"""

from __future__ import annotations

import ipaddress
import json
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest
from weightroll_dev.realnode import RealNode, down, host, missing_prerequisites, up
from weightroll_dev.realnode.config import NODE_ADDRESS, POD_SUBNET
from weightroll_dev.realnode.images import TINY_IMAGE
from weightroll_dev.realnode.pods import host_python_mounts

REPO = Path(__file__).resolve().parents[2]

MISSING = missing_prerequisites()
pytestmark = [
    pytest.mark.realnode,
    pytest.mark.skipif(bool(MISSING), reason="real node needs: " + "; ".join(MISSING)),
]

#: A pod on the tiny image, run from the host's /usr, with a readiness probe only the kubelet
#: evaluates: its Ready condition comes from the kubelet's probe worker, not from any client.
POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "tiny", "namespace": "default"},
    "spec": {
        "terminationGracePeriodSeconds": 1,
        "containers": [
            {
                "name": "sleeper",
                "image": TINY_IMAGE,
                "imagePullPolicy": "Never",
                "command": ["/usr/bin/sleep", "3600"],
                "readinessProbe": {
                    "exec": {"command": ["/usr/bin/test", "-d", "/usr/bin"]},
                    "periodSeconds": 1,
                },
                "volumeMounts": [{"name": "usr", "mountPath": "/usr", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "usr", "hostPath": {"path": "/usr", "type": "Directory"}}],
    },
}


GATE = "weightroll.io/weights-ready"
#: A pod behind a Service with the operator's readiness gate: Ready only once the gate is True.
GATED_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "gated", "namespace": "default", "labels": {"app": "gated"}},
    "spec": {
        "terminationGracePeriodSeconds": 1,
        "readinessGates": [{"conditionType": GATE}],
        "containers": [
            {
                "name": "sleeper",
                "image": TINY_IMAGE,
                "imagePullPolicy": "Never",
                # The probe passes while /tmp/ready exists: the test breaks it by removing it.
                "command": ["/usr/bin/sh", "-c", "touch /tmp/ready && exec sleep 3600"],
                "readinessProbe": {
                    "exec": {"command": ["/usr/bin/test", "-e", "/tmp/ready"]},
                    "periodSeconds": 1,
                },
                "ports": [{"containerPort": 8000, "name": "http"}],
                "volumeMounts": [{"name": "usr", "mountPath": "/usr", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "usr", "hostPath": {"path": "/usr", "type": "Directory"}}],
    },
}
SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "gated", "namespace": "default"},
    "spec": {"selector": {"app": "gated"}, "ports": [{"port": 8000, "targetPort": "http"}]},
}


def _set_gate(node: RealNode, status: str) -> None:
    patch = {"status": {"conditions": [{"type": GATE, "status": status}]}}
    out = node.kubectl("patch", "pod", "gated", "--subresource=status", "-p", json.dumps(patch))
    assert out.returncode == 0, out.stderr


def _slice_readiness(node: RealNode) -> list[bool]:
    out = node.kubectl(
        "get", "endpointslices", "-l", "kubernetes.io/service-name=gated", "-o", "json"
    )
    assert out.returncode == 0, out.stderr
    return [
        bool(e.get("conditions", {}).get("ready"))
        for s in json.loads(out.stdout)["items"]
        for e in s.get("endpoints") or []
    ]


def _wait_slice(node: RealNode, ready: bool, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while _slice_readiness(node) != [ready]:
        assert time.monotonic() < deadline, f"EndpointSlice never {ready}: {_slice_readiness(node)}"
        time.sleep(0.5)


def _check_gate_decides_ready_and_endpoints(node: RealNode) -> None:
    for manifest in (SERVICE, GATED_POD):
        created = node.kubectl("apply", "-f", "-", input_=json.dumps(manifest))
        assert created.returncode == 0, created.stderr
    running = node.kubectl("wait", "--for=condition=ContainersReady", "pod/gated",
                           "--timeout=120s", timeout=130)  # fmt: skip
    assert running.returncode == 0, running.stderr
    # Containers ready, gate absent: the kubelet keeps the pod unready and out of the slice.
    pod = json.loads(node.kubectl("get", "pod", "gated", "-o", "json").stdout)
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"]
    assert ready == "False"
    _wait_slice(node, ready=False)

    _set_gate(node, "True")
    waited = node.kubectl("wait", "--for=condition=Ready", "pod/gated", "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    _wait_slice(node, ready=True)

    _set_gate(node, "False")
    waited = node.kubectl("wait", "--for=condition=Ready=false", "pod/gated", "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    _wait_slice(node, ready=False)

    # A failing probe takes the pod out even with the gate True.
    _set_gate(node, "True")
    _wait_slice(node, ready=True)
    pod = json.loads(node.kubectl("get", "pod", "gated", "-o", "json").stdout)
    container_id = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    broken = node.ctr("tasks", "exec", "--exec-id", "break-probe", container_id,
                      "/usr/bin/rm", "/tmp/ready")  # fmt: skip
    assert broken.returncode == 0, broken.stderr
    waited = node.kubectl("wait", "--for=condition=Ready=false", "pod/gated", "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    _wait_slice(node, ready=False)
    pod = json.loads(node.kubectl("get", "pod", "gated", "-o", "json").stdout)
    conditions = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert conditions[GATE] == "True" and conditions["ContainersReady"] == "False"


def _check_checkout_python_runs_in_a_pod(node: RealNode) -> None:
    """The venv's interpreter imports the checkout's packages in a tiny-image pod (no vLLM)."""
    venv = Path(sys.prefix)
    volumes, mounts = host_python_mounts(venv, REPO)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "python", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "python",
                    "image": TINY_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": [str(venv / "bin" / "python"), "-c",
                                "import engine_agent.protocol, weightroll_operator"],
                    "env": [{"name": "PYTHONPATH", "value": f"{REPO}:{REPO / 'operator'}"}],
                    "volumeMounts": mounts,
                }
            ],
            "volumes": volumes,
        },
    }  # fmt: skip
    created = node.kubectl("apply", "-f", "-", input_=json.dumps(pod))
    assert created.returncode == 0, created.stderr
    done = node.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/python",
                        "--timeout=120s", timeout=130)  # fmt: skip
    assert done.returncode == 0, (
        done.stderr + node.kubectl("get", "pod", "python", "-o", "yaml").stdout
    )


def _wait_restarted_and_ready(node: RealNode, limit: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while True:
        pod = json.loads(node.kubectl("get", "pod", "tiny", "-o", "json").stdout)
        (status,) = pod["status"]["containerStatuses"]
        if status["restartCount"] >= 1 and status["ready"]:
            return cast(dict[str, Any], status)
        assert time.monotonic() < deadline, f"not restarted and Ready: {status}"
        time.sleep(1)


def test_kubelet_decides_ready_restarts_and_gates_and_down_leaves_nothing(tmp_path: Path) -> None:
    root = tmp_path / "node"
    before = host.footprint(str(root))
    node = up(root)
    try:
        nodes = json.loads(node.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        assert [n["metadata"]["name"] for n in nodes] == [node.node_name]
        addresses = {a["type"]: a["address"] for a in nodes[0]["status"]["addresses"]}
        assert addresses["InternalIP"] == NODE_ADDRESS

        created = node.kubectl("apply", "-f", "-", input_=json.dumps(POD))
        assert created.returncode == 0, created.stderr
        waited = node.kubectl("wait", "--for=condition=Ready", "pod/tiny", "--timeout=120s",
                              timeout=130)  # fmt: skip
        assert waited.returncode == 0, waited.stderr + node.kubectl("describe", "pod/tiny").stdout
        pod = json.loads(node.kubectl("get", "pod", "tiny", "-o", "json").stdout)
        assert pod["spec"]["nodeName"] == node.node_name  # placed by the real scheduler
        assert pod["status"]["hostIP"] == NODE_ADDRESS
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(POD_SUBNET)
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and "running" in status["state"]
        # The sandbox and the container are containerd tasks of the node.
        tasks = node.ctr("tasks", "ls")
        assert tasks.stdout.count("RUNNING") == 2, tasks.stdout

        # A container that dies is restarted by the kubelet (restartPolicy Always) and is made
        # Ready again by its probe: nothing but the kubelet acts on the pod here.
        container_id = status["containerID"].split("://", 1)[1]
        killed = node.ctr("tasks", "kill", "--signal", "SIGKILL", container_id)
        assert killed.returncode == 0, killed.stderr
        status = _wait_restarted_and_ready(node)
        assert status["restartCount"] >= 1
        assert status["lastState"]["terminated"]["exitCode"] == 137

        _check_gate_decides_ready_and_endpoints(node)
        _check_checkout_python_runs_in_a_pod(node)
        # The apiserver reaches the kubelet (logs, exec) at the node address, not by name.
        execed = node.kubectl("exec", "tiny", "--", "/usr/bin/true")
        assert execed.returncode == 0, execed.stderr
        # Confinement: nothing was sent towards any address outside the namespace.
        assert node.packets_towards_outside() == 0
    finally:
        problems = down(root)
    assert problems == []
    assert before.difference(host.footprint(str(root))) == {}
