"""Issue 31 item 1, acceptance: the chart's example workload with only the inject label comes up
Ready on the dev cluster and rolls v1 -> v2.

``weightroll_dev dev up --inject`` installs the chart with ``workloadExample.inject`` (the pod
template carries the ``weightroll.io/inject`` label and the annotations naming its Secret and
boot version; no readiness gate, vLLM flags, agent or weightroll volumes) and points the
chart's own webhook configurations at the local operator. The pods the API server stores carry
the four pieces, their real vLLM servers and agents come up Ready on v1, and a WeightUpdate rolls
them to v2. The refusal of a pod the webhook cannot complete is checked on the same API server.
The fleet is the e2e tier's ``injected`` fixture (``tests/e2e/conftest.py``), which
docs/getting-started.md runs on too.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from weightroll_dev.devcluster.workload import WORKLOAD

from tests.e2e.conftest import GATE, INJECTED_PODS, NAMESPACE, Fleet

pytestmark = [pytest.mark.cluster, pytest.mark.server, pytest.mark.timeout(1500)]

PODS = INJECTED_PODS


def test_label_only_example_comes_up_ready_and_rolls_v1_to_v2(injected: Fleet) -> None:
    fleet = injected
    template = json.loads(fleet.kubectl("get", "deploy", WORKLOAD, "-n", NAMESPACE, "-o", "json"))[
        "spec"
    ]["template"]
    assert template["metadata"]["labels"]["weightroll.io/inject"] == "true"
    assert "readinessGates" not in template["spec"]
    assert [c["name"] for c in template["spec"]["containers"]] == ["vllm"]
    for pod in PODS:
        spec = fleet.pod(pod)["spec"]
        assert spec["readinessGates"] == [{"conditionType": GATE}]
        assert [c["name"] for c in spec["containers"]] == ["vllm", "weightroll-agent"]
        assert fleet.condition(pod, "Ready") == "True"
        assert fleet.agent_state(pod)["version"] == "v1"
    fleet.apply_weightupdate("to-v2", "v2")
    status = fleet.wait_phase("to-v2", "Succeeded", "Failed", timeout=300)
    assert status["phase"] == "Succeeded", status
    assert status["replicas"]["updated"] == len(PODS), status
    fleet.wait_pods("Ready", "True", PODS, timeout=60)
    for pod in PODS:
        assert fleet.condition(pod, GATE) == "True"
        state = fleet.agent_state(pod)
        assert state["version"] == "v2" and state["ready"], state


def test_a_labelled_pod_without_checkpoints_is_refused_with_the_reason(injected: Fleet) -> None:
    template = json.loads(
        injected.kubectl("get", "deploy", WORKLOAD, "-n", NAMESPACE, "-o", "json")
    )["spec"]["template"]
    spec = template["spec"]
    spec["volumes"] = []
    spec["containers"][0]["volumeMounts"] = []
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "no-checkpoints", "namespace": NAMESPACE, **template["metadata"]},
        "spec": spec,
    }
    proc = subprocess.run(
        ["kubectl", f"--kubeconfig={injected.info.kubeconfig}", "create", "-f", "-"],
        input=yaml.safe_dump(pod),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0, proc.stdout
    assert "no checkpoint volume" in proc.stderr, proc.stderr
