"""Cluster tier: bad WeightUpdates are rejected at the door (issue 11 finding 9, item I).

``weightroll-operator --webhook-port`` runs as a local process with a certificate for
127.0.0.1; a ValidatingWebhookConfiguration like the chart's, but pointing the real
kube-apiserver 1.20 at that loopback URL, sends it every CREATE and UPDATE of a WeightUpdate in
one test namespace. Each invalid spec is refused by ``kubectl apply`` with a message naming the
field; valid ones are stored.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_dev.devcluster.apiserver import free_ports
from weightroll_dev.devcluster.bringup import loopback_certificates
from weightroll_dev.devcluster.operator_process import launch_operator, log_tail, stop_process

from tests.harness.apiserver import KubeCluster, kubectl

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
#: The WeightUpdate CRD without CEL rules, for the 1.20 apiserver (crdgen).
CRD = REPO / "crds" / "pre-1.25" / "weightupdates.weightroll.io.yaml"
LABEL = "weightroll.io/webhook-test"


def ensure_crd(kube_cluster: KubeCluster) -> bool:
    """The WeightUpdate CRD without CEL rules (the 1.20 apiserver knows none; crdgen), applied
    unless a chart release installed it earlier in the session (Helm owns that one, so it is
    left alone). Returns whether it was applied here: then :func:`remove_crd` afterwards, so a
    later ``helm install`` can own it."""
    ours = kubectl(kube_cluster, "get", "crd", "weightupdates.weightroll.io", check=False)
    applied = ours.returncode != 0
    if applied:
        kubectl(kube_cluster, "apply", "-f", str(CRD))
    kubectl(kube_cluster, "wait", "--for=condition=established", "--timeout=30s",
            "crd/weightupdates.weightroll.io")  # fmt: skip
    return applied


def remove_crd(kube_cluster: KubeCluster) -> None:
    kubectl(kube_cluster, "delete", "-f", str(CRD), "--timeout=60s", check=False)


@contextlib.contextmanager
def webhook_operator(
    kube_cluster: KubeCluster, work: Path, namespace: str, env: dict[str, str] | None = None
) -> Iterator[tuple[int, Path]]:
    """``weightroll-operator`` watching ``namespace`` and serving its admission webhooks on
    127.0.0.1 with the certificate in ``work``, once it says so; yields the webhook port and the
    operator's log, and stops the operator afterwards (what the caller undoes inside the block
    runs while the operator still serves: it releases WeightUpdates' finalizers)."""
    (port,) = free_ports(1)
    log = work / "operator.log"
    proc = launch_operator(
        kube_cluster.kubeconfig,
        log,
        free_ports(1)[0],
        f"--namespace={namespace}",
        f"--webhook-port={port}",
        f"--webhook-cert-dir={work}",
        env={"WEIGHTROLL_WEBHOOK_ADDR": "127.0.0.1", **(env or {})},
    )
    try:
        deadline = time.monotonic() + 60
        while b"Serving the admission webhook" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log_tail(log)
            time.sleep(0.2)
        yield port, log
    finally:
        stop_process(proc)


def _webhook_configuration(name: str, namespace: str, port: int, ca: bytes) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration, at a loopback URL, for one namespace."""
    from tests.charts.helpers import find, objects, render

    rendered = find(objects(render()), "ValidatingWebhookConfiguration")
    config = copy.deepcopy(rendered)
    config["metadata"] = {"name": name}
    (hook,) = config["webhooks"]
    hook["clientConfig"] = {
        "url": f"https://127.0.0.1:{port}/validate",
        "caBundle": base64.b64encode(ca).decode(),
    }
    hook["namespaceSelector"] = {"matchLabels": {LABEL: namespace}}
    return dict(config)


@pytest.fixture(scope="module")
def guarded(kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A namespace whose WeightUpdates go through the operator's webhook; yields its name."""
    work = tmp_path_factory.mktemp("webhook")
    ca = loopback_certificates(work)
    applied = ensure_crd(kube_cluster)
    ns = f"webhook-{uuid.uuid4().hex[:6]}"
    kubectl(kube_cluster, "create", "namespace", ns)
    kubectl(kube_cluster, "label", "namespace", ns, f"{LABEL}={ns}")
    name = f"weightroll-test-{ns}"
    with webhook_operator(kube_cluster, work, ns) as (port, log):
        try:
            config = _webhook_configuration(name, ns, port, ca)
            kubectl(kube_cluster, "apply", "-f", "-", input_=yaml.safe_dump(config))
            # The API server picks a new webhook configuration up from its informer a moment
            # later.
            probe = _wu(ns, "probe", selector={})
            deadline = time.monotonic() + 30
            while _apply(kube_cluster, probe).returncode == 0:
                kubectl(kube_cluster, "delete", "wu", "probe", "-n", ns, "--wait=false",
                        check=False)  # fmt: skip
                assert time.monotonic() < deadline, "webhook never called\n" + log_tail(log)
                time.sleep(0.5)
            yield ns
        finally:
            kubectl(kube_cluster, "delete", "validatingwebhookconfiguration", name, check=False)
            # The running operator releases the WeightUpdates (finalizers) before it stops.
            kubectl(kube_cluster, "delete", "wu", "--all", "-n", ns, "--timeout=60s", check=False)
            kubectl(kube_cluster, "delete", "namespace", ns, "--wait=false", check=False)
    if applied:
        remove_crd(kube_cluster)


def _wu(ns: str, name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": {"matchLabels": {"app": "llm"}},
        "version": "v2",
        "source": {"uri": "file:///models/v2"},
        "agent": {"tokenSecretRef": {"name": "token"}},
    }
    body.update(spec)
    return {
        "apiVersion": "weightroll.io/v1alpha1",
        "kind": "WeightUpdate",
        "metadata": {"name": name, "namespace": ns},
        "spec": body,
    }


def _apply(cluster: KubeCluster, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return kubectl(cluster, "apply", "-f", "-", input_=yaml.safe_dump(obj), check=False)


BAD = [
    ({"selector": {}}, "spec.selector must not be empty"),
    (
        {"selector": {"matchExpressions": [{"key": "app", "operator": "In"}]}},
        "spec.selector.matchExpressions.0: values must not be empty when operator is In",
    ),
    (
        {"source": {"uri": "file:///models/v2", "mode": "sparse"}},
        "spec.source.baseVersion is required when spec.source.mode is sparse",
    ),
    ({"source": {"uri": "s3://bucket/v2"}}, "spec.source.uri"),
    (
        {"strategy": {"updateTimeoutSeconds": 600, "progressDeadlineSeconds": 60}},
        "spec.strategy.progressDeadlineSeconds (60) must be greater than "
        "spec.strategy.updateTimeoutSeconds (600)",
    ),
    # The next two, and the URI above, are refused by the CRD's OpenAPI schema already
    # (minLength, pattern), which the API server checks before validating admission: still at
    # the door, naming the field (the webhook has the same rules for an older CRD).
    ({"agent": {"tokenSecretRef": {"name": "token", "key": ""}}}, "spec.agent.tokenSecretRef.key"),
    ({"version": "V2_1"}, "spec.version"),
]
#: Fields the CRD schema checks itself; every other rule is only the webhook's.
SCHEMA_CHECKED = ("spec.agent.tokenSecretRef.key", "spec.version", "spec.source.uri")


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_invalid_weightupdate_is_rejected_naming_the_field(
    kube_cluster: KubeCluster, guarded: str, spec: dict[str, Any], message: str
) -> None:
    proc = _apply(kube_cluster, _wu(guarded, f"bad-{uuid.uuid4().hex[:6]}", **spec))
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr
    if not message.startswith(SCHEMA_CHECKED):
        assert "admission webhook" in proc.stderr and "denied the request" in proc.stderr


def test_valid_weightupdate_is_stored_and_its_source_is_immutable_per_version(
    kube_cluster: KubeCluster, guarded: str
) -> None:
    assert _apply(kube_cluster, _wu(guarded, "good")).returncode == 0
    assert _apply(kube_cluster, _wu(guarded, "canonical", version="v2-1")).returncode == 0
    moved = _wu(guarded, "good", source={"uri": "file:///models/other"})
    proc = _apply(kube_cluster, moved)
    assert proc.returncode != 0
    assert "spec.source is immutable while spec.version is unchanged (v2)" in proc.stderr
    rolled = _wu(guarded, "good", version="v3", source={"uri": "file:///models/v3"})
    assert _apply(kube_cluster, rolled).returncode == 0, "a new version may bring a new source"
    paused = _wu(guarded, "good", version="v3", source={"uri": "file:///models/v3"}, paused=True)
    assert _apply(kube_cluster, paused).returncode == 0
