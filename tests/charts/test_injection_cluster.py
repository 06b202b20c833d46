"""Cluster tier: pod injection through the real kube-apiserver 1.20 (issue 31 item 1).

``weightroll-operator --webhook-port`` runs as a local process with the chart's injection
settings (the ``WEIGHTROLL_INJECT_*`` variables of the rendered Deployment) and a certificate for
127.0.0.1; the chart's MutatingWebhookConfiguration, pointed at that loopback URL and limited to
one test namespace, makes the API server send it every pod CREATE there. A pod of the chart's
label-only example is stored with the four pieces the hand-written example carries; a pod it
cannot complete is refused with the reason; an unlabelled pod and an already prepared one are
stored as sent.
"""

from __future__ import annotations

import base64
import copy
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_dev.devcluster.bringup import loopback_certificates
from weightroll_dev.devcluster.operator_process import log_tail

from tests.charts.test_webhook_cluster import ensure_crd, remove_crd, webhook_operator
from tests.harness.apiserver import KubeCluster, kubectl

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
NS_LABEL = "weightroll.io/inject-test"


def _renders() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The chart with the example workload: injected (label only) and hand-written."""
    from tests.charts.helpers import objects, render, scenario_values

    values = scenario_values("workload-values.yaml")
    values["workloadExample"].pop("trainerNetworks")
    hand = objects(render(values))
    values["workloadExample"]["inject"] = True
    return objects(render(values)), hand


def _find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    from tests.charts.helpers import find

    return find(objs, kind, name)


@pytest.fixture(scope="module")
def charts() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return _renders()


@pytest.fixture(scope="module")
def injecting(
    kube_cluster: KubeCluster,
    tmp_path_factory: pytest.TempPathFactory,
    charts: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> Iterator[str]:
    """A namespace whose pod CREATEs go through the operator's /mutate; yields its name."""
    labelled, _ = charts
    work = tmp_path_factory.mktemp("inject")
    ca = loopback_certificates(work)
    applied = ensure_crd(kube_cluster)
    ns = f"inject-{uuid.uuid4().hex[:6]}"
    kubectl(kube_cluster, "create", "namespace", ns)
    kubectl(kube_cluster, "label", "namespace", ns, f"{NS_LABEL}={ns}")
    # no controller-manager here: the ServiceAccount admission plugin wants the default one
    kubectl(kube_cluster, "create", "serviceaccount", "default", "-n", ns)
    deploy = _find(labelled, "Deployment", "weightroll-operator")
    (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in ctr["env"] if e["name"].startswith("WEIGHTROLL_INJECT_")}
    assert env, "the chart passes no injection settings to the operator"
    name = f"weightroll-inject-{ns}"
    # agents serve TLS exactly when the operator verifies them (the chart's default)
    tls = {"WEIGHTROLL_AGENT_CA_FILE": str(work / "ca.crt"), **env}
    with webhook_operator(kube_cluster, work, ns, tls) as (port, log):
        try:
            config = copy.deepcopy(_find(labelled, "MutatingWebhookConfiguration"))
            config["metadata"] = {"name": name}
            (hook,) = config["webhooks"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}/mutate",
                "caBundle": base64.b64encode(ca).decode(),
            }
            hook["namespaceSelector"] = {"matchLabels": {NS_LABEL: ns}}
            kubectl(kube_cluster, "apply", "-f", "-", input_=yaml.safe_dump(config))
            # The API server picks a new webhook configuration up from its informer a moment later.
            probe = _pod(ns, "probe", {"containers": [{"name": "other", "image": "x"}]}, True)
            deadline = time.monotonic() + 30
            while "vLLM container not found" not in (answer := _create(kube_cluster, probe)).stderr:
                if answer.returncode == 0:
                    kubectl(kube_cluster, "delete", "pod", "probe", "-n", ns, "--wait=false")
                never = f"webhook never called: {answer.stderr}\n"
                assert time.monotonic() < deadline, never + log_tail(log)
                time.sleep(0.5)
            yield ns
        finally:
            kubectl(kube_cluster, "delete", "mutatingwebhookconfiguration", name, check=False)
            kubectl(kube_cluster, "delete", "namespace", ns, "--wait=false", check=False)
    if applied:
        remove_crd(kube_cluster)


def _pod(
    ns: str,
    name: str,
    spec: dict[str, Any],
    labelled: bool,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    labels = {"app": "llm"} | ({"weightroll.io/inject": "true"} if labelled else {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels,
            "annotations": annotations or {},
        },
        # (no token controller here either: the ServiceAccount's token is never created)
        "spec": {"automountServiceAccountToken": False, **copy.deepcopy(spec)},
    }


def _example(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    template = _find(objs, "Deployment", "vllm-example")["spec"]["template"]
    return template["spec"], template["metadata"].get("annotations") or {}


def _create(cluster: KubeCluster, obj: dict[str, Any]) -> Any:
    return kubectl(cluster, "create", "-f", "-", input_=yaml.safe_dump(obj), check=False)


def _stored(cluster: KubeCluster, ns: str, name: str) -> dict[str, Any]:
    out = kubectl(cluster, "get", "pod", name, "-n", ns, "-o", "json").stdout
    pod: dict[str, Any] = json.loads(out)
    return pod


def _within(expected: Any, actual: Any, where: str = "") -> None:
    """``expected`` is part of ``actual`` (the API server adds defaults: protocol, timeouts)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing"
            _within(value, actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _within(e, a, f"{where}[{i}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


def test_labelled_example_pod_is_stored_with_the_four_pieces(
    kube_cluster: KubeCluster,
    injecting: str,
    charts: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    labelled, hand = charts
    spec, annotations = _example(labelled)
    assert [c["name"] for c in spec["containers"]] == ["vllm"] and "readinessGates" not in spec
    assert _create(kube_cluster, _pod(injecting, "llm-0", spec, True, annotations)).returncode == 0
    stored = _stored(kube_cluster, injecting, "llm-0")["spec"]
    want, _ = _example(hand)
    assert stored["readinessGates"] == want["readinessGates"]
    got = {c["name"]: c for c in stored["containers"]}
    assert list(got) == ["vllm", "weightroll-agent"]
    _within(want["containers"][1], got["weightroll-agent"], "agent")
    vllm = want["containers"][0]
    assert sorted(got["vllm"]["args"]) == sorted(vllm["args"])
    assert sorted(got["vllm"]["env"], key=str) == sorted(vllm["env"], key=str)
    volumes = {v["name"]: v for v in stored["volumes"]}
    for volume in want["volumes"]:
        _within(volume, volumes[volume["name"]], volume["name"])


def test_pod_that_cannot_be_completed_is_refused_with_the_reason(
    kube_cluster: KubeCluster,
    injecting: str,
    charts: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    spec, annotations = _example(charts[0])
    no_volume = copy.deepcopy(spec)
    no_volume["volumes"] = []
    no_volume["containers"][0]["volumeMounts"] = []
    proc = _create(kube_cluster, _pod(injecting, "no-volume", no_volume, True, annotations))
    assert proc.returncode != 0
    assert "denied the request" in proc.stderr and "no checkpoint volume" in proc.stderr
    renamed = copy.deepcopy(spec)
    renamed["containers"][0]["name"] = "engine"
    proc = _create(kube_cluster, _pod(injecting, "no-vllm", renamed, True, annotations))
    assert proc.returncode != 0 and "vLLM container not found" in proc.stderr
    no_token = {k: v for k, v in annotations.items() if "token" not in k}
    proc = _create(kube_cluster, _pod(injecting, "no-token", spec, True, no_token))
    assert proc.returncode != 0 and "weightroll.io/agent-token-secret" in proc.stderr


def test_unlabelled_and_prepared_pods_are_stored_as_sent(
    kube_cluster: KubeCluster,
    injecting: str,
    charts: tuple[list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    labelled, hand = charts
    spec, _ = _example(labelled)
    assert _create(kube_cluster, _pod(injecting, "plain", spec, False)).returncode == 0
    plain = _stored(kube_cluster, injecting, "plain")["spec"]
    assert [c["name"] for c in plain["containers"]] == ["vllm"]
    assert "readinessGates" not in plain and "env" not in plain["containers"][0]
    # Re-admission of what injection produces (the hand-written example is exactly that).
    prepared, _ = _example(hand)
    assert _create(kube_cluster, _pod(injecting, "prepared", prepared, True)).returncode == 0
    stored = _stored(kube_cluster, injecting, "prepared")["spec"]
    assert stored["readinessGates"] == prepared["readinessGates"]
    assert [c["name"] for c in stored["containers"]] == ["vllm", "weightroll-agent"]
    assert [c["args"] for c in stored["containers"]] == [c["args"] for c in prepared["containers"]]
    assert [v["name"] for v in stored["volumes"]] == [v["name"] for v in prepared["volumes"]]
