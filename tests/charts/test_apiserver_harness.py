"""Cluster tier: the test kube-apiserver behaves like a real one where our tests depend on it.

Guards the self-built kube-apiserver 1.20.2 (scripts/kube-apiserver.sh) against build defects: a
Go-version incompatibility once made it reject every "", 0 and false in a custom resource as null,
which real clusters accept. Also pins the `pods/status` semantics the operator relies on
(operator.md §2.2) and that RBAC authorization is on.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml

from tests.harness.apiserver import KubeCluster, kubectl

pytestmark = pytest.mark.cluster

GROUP = "harness.weightroll.io"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"gadgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "names": {"kind": "Gadget", "plural": "gadgets", "singular": "gadget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "text": {"type": "string"},
                                    "count": {"type": "integer", "minimum": 0},
                                    "flag": {"type": "boolean"},
                                    "portOrPercent": {"x-kubernetes-int-or-string": True},
                                },
                            },
                            "status": {
                                "type": "object",
                                "properties": {
                                    "message": {"type": "string"},
                                    "failed": {"type": "integer"},
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def _apply(cluster: KubeCluster, obj: Mapping[str, Any]) -> None:
    kubectl(cluster, "apply", "-f", "-", input_=yaml.safe_dump(obj))


@pytest.fixture(scope="module")
def namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    name = f"harness-{uuid.uuid4().hex[:6]}"
    _apply(kube_cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    # No controller-manager: the `default` ServiceAccount must be created by hand.
    _apply(
        kube_cluster,
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "default", "namespace": name},
            "automountServiceAccountToken": False,
        },
    )
    yield name
    kubectl(kube_cluster, "delete", "namespace", name, "--wait=false", check=False)


def test_custom_resources_keep_empty_strings_zeros_and_false(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    _apply(kube_cluster, CRD)
    try:
        kubectl(kube_cluster, "wait", "--for=condition=established", f"crd/gadgets.{GROUP}")
        spec = {"text": "", "count": 0, "flag": False, "portOrPercent": "0%"}
        _apply(
            kube_cluster,
            {
                "apiVersion": f"{GROUP}/v1",
                "kind": "Gadget",
                "metadata": {"name": "g", "namespace": namespace},
                "spec": spec,
            },
        )
        kubectl(
            kube_cluster,
            "patch",
            f"gadgets.{GROUP}",
            "g",
            "-n",
            namespace,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": {"message": "", "failed": 0}}),
        )
        got = json.loads(
            kubectl(
                kube_cluster, "get", f"gadgets.{GROUP}", "g", "-n", namespace, "-o", "json"
            ).stdout
        )
        assert got["spec"] == spec
        assert got["status"] == {"message": "", "failed": 0}
        bad = kubectl(
            kube_cluster,
            "patch",
            f"gadgets.{GROUP}",
            "g",
            "-n",
            namespace,
            "--type=merge",
            "-p",
            json.dumps({"spec": {"count": -1}}),
            check=False,
        )
        assert bad.returncode != 0 and "spec.count" in bad.stderr
    finally:
        kubectl(kube_cluster, "delete", "crd", f"gadgets.{GROUP}", "--wait=false", check=False)


def _conditions(cluster: KubeCluster, namespace: str, pod: str) -> dict[str, str]:
    out = kubectl(
        cluster, "get", "pod", pod, "-n", namespace, "-o", "jsonpath={.status.conditions}"
    ).stdout
    return {c["type"]: c["status"] for c in json.loads(out or "[]")}


def test_pod_status_strategic_merge_keeps_other_conditions(
    kube_cluster: KubeCluster, namespace: str
) -> None:
    """The operator's gate write (strategic merge) must not drop kubelet's conditions."""
    gate = "weightroll.io/weights-ready"
    _apply(
        kube_cluster,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": namespace},
            "spec": {
                "automountServiceAccountToken": False,
                "readinessGates": [{"conditionType": gate}],
                "containers": [{"name": "c", "image": "example.invalid/none"}],
            },
        },
    )
    kubelet = {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.9",
            "conditions": [
                {"type": t, "status": "True"} for t in ("ContainersReady", "Ready", gate)
            ],
        }
    }
    patch = ["patch", "pod", "p", "-n", namespace, "--subresource=status"]
    kubectl(kube_cluster, *patch, "--type=strategic", "-p", json.dumps(kubelet))
    gate_off = {"status": {"conditions": [{"type": gate, "status": "False"}]}}
    kubectl(kube_cluster, *patch, "--type=strategic", "-p", json.dumps(gate_off))
    assert _conditions(kube_cluster, namespace, "p") == {
        "ContainersReady": "True",
        "Ready": "True",  # nothing recomputes Ready here: the pod simulator must (tooling.md §1)
        gate: "False",
    }
    # A JSON merge patch replaces the list: why the operator never writes pod conditions via kopf.
    kubectl(kube_cluster, *patch, "--type=merge", "-p", json.dumps(gate_off))
    assert _conditions(kube_cluster, namespace, "p") == {gate: "False"}


def test_rbac_authorization_is_on(kube_cluster: KubeCluster) -> None:
    if kube_cluster.external:
        pytest.skip("only for the built-in apiserver (static operator token)")
    assert kube_cluster.operator_kubeconfig is not None
    proc = kubectl(
        kube_cluster,
        "auth",
        "can-i",
        "delete",
        "nodes",
        kubeconfig=kube_cluster.operator_kubeconfig,
        check=False,
    )
    assert proc.stdout.strip() == "no"
