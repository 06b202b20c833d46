"""The real node (weightroll_dev.realnode) end to end: a real kubelet makes a pod Ready and
restarts its killed container, and ``down`` leaves nothing on the host.

Runs as root with the node binaries built (``bash scripts/kube-apiserver.sh build``) and
containerd, runc and the CNI plugins installed (``scripts/system-deps.sh``); otherwise skipped
with the missing pieces named. Never runs vLLM: the pod is the tiny image with the host's /usr.
"""

from __future__ import annotations

import ipaddress
import json
import time
from pathlib import Path
from typing import Any, cast

import pytest
from weightroll_dev.realnode import RealNode, down, host, missing_prerequisites, up
from weightroll_dev.realnode.config import NODE_ADDRESS, POD_SUBNET
from weightroll_dev.realnode.images import TINY_IMAGE

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


def _wait_restarted_and_ready(node: RealNode, limit: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    while True:
        pod = json.loads(node.kubectl("get", "pod", "tiny", "-o", "json").stdout)
        (status,) = pod["status"]["containerStatuses"]
        if status["restartCount"] >= 1 and status["ready"]:
            return cast(dict[str, Any], status)
        assert time.monotonic() < deadline, f"not restarted and Ready: {status}"
        time.sleep(1)


def test_kubelet_makes_a_pod_ready_and_down_leaves_nothing(tmp_path: Path) -> None:
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
    finally:
        problems = down(root)
    assert problems == []
    assert before.difference(host.footprint(str(root))) == {}
