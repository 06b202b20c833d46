"""Cluster tier: the chart installs, upgrades and uninstalls on a real kube-apiserver, and its
RBAC confines the operator's ServiceAccount to the release namespace by default (issue 28 item
7). That the rules grant exactly the verbs the operator uses is shown from the audit log of a
real run, not from a list here (tests/charts/test_rbac_audit_cluster.py).

Runs against the built-in kube-apiserver 1.20.2 (tests/harness/apiserver.py) or the cluster in
WEIGHTROLL_KUBECONFIG; skipped with the build command when neither is available. The built-in
apiserver has no kubelet: the operator Deployment is stored but never runs here (the e2e tests run
the operator in-process under the chart's ServiceAccount identity).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_dev.devcluster.operator_process import write_token_kubeconfig
from weightroll_dev.devcluster.workload import default_service_account

from tests.charts.helpers import (
    CHART,
    NAMESPACE,
    RELEASE,
    crd_available,
    helm_python,
    scenario_values,
    with_crd_fallback,
)
from tests.harness.apiserver import (
    OPERATOR_NAMESPACE,
    OPERATOR_SERVICEACCOUNT,
    KubeCluster,
    kubectl,
    service_account_token,
)
from tests.harness.ports import free_port

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

kubernetes = pytest.importorskip("kubernetes")

#: Granted to every authenticated user by the default system:basic-user role.
BASELINE = {
    ("authorization.k8s.io", "selfsubjectaccessreviews", "create"),
    ("authorization.k8s.io", "selfsubjectrulesreviews", "create"),
}
#: A few of the operator's requests (the audit test has them all), allowed in the release
#: namespace only.
SAMPLE = [
    ("weightroll.io", "weightupdates", "watch"),
    ("weightroll.io", "weightupdates/status", "patch"),
    ("", "pods", "list"),
    ("", "pods/status", "patch"),
    ("", "events", "create"),
]
#: Never used (the audit log of a rollout and a deletion shows none), so not granted (issue 28).
UNUSED = [
    ("", "pods", "get"),
    ("", "pods/status", "get"),
    ("weightroll.io", "weightupdates", "get"),
    ("weightroll.io", "weightupdates/status", "get"),
]
FORBIDDEN = [
    ("", "pods", "create"),
    ("", "pods", "delete"),
    ("", "pods", "update"),
    ("", "pods/status", "update"),
    ("", "secrets", "list"),
    ("", "secrets", "watch"),
    ("weightroll.io", "weightupdates", "create"),
    ("weightroll.io", "weightupdates", "delete"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "create"),
    ("kopf.dev", "kopfpeerings", "list"),
    ("coordination.k8s.io", "leases", "create"),
    # Clusterwide kopf never lists namespaces (only to resolve a glob in watchNamespaces).
    ("", "namespaces", "list"),
]


def _api_client(cluster: KubeCluster, token: str) -> Any:
    cfg = kubernetes.client.Configuration()
    cfg.host = cluster.server
    cfg.verify_ssl = False
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return kubernetes.client.ApiClient(cfg)


@pytest.fixture(scope="module")
def installed(kube_cluster: KubeCluster) -> Iterator[KubeCluster]:
    """The chart installed as release `weightroll` with the workload scenario."""
    config = helm_python.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=NAMESPACE)
    # The webhook objects install (on 1.20 too); `Ignore` because this API server cannot route
    # to the webhook Service (no kube-proxy): WeightUpdates below are admitted unchecked here.
    # The webhook itself is tested on loopback in test_webhook_cluster.py.
    values = with_crd_fallback(
        {**scenario_values("workload-values.yaml"), "webhook": {"failurePolicy": "Ignore"}}
    )
    try:
        config.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=60)
        config.install(str(CHART), RELEASE, values, namespace=NAMESPACE, create_namespace=True)
        yield kube_cluster
    finally:
        config.uninstall(RELEASE, ignore_not_found=True)
        config.close()


def _operator_token(cluster: KubeCluster) -> str:
    if cluster.operator_token and cluster.operator_user == (
        f"system:serviceaccount:{NAMESPACE}:{OPERATOR_SERVICEACCOUNT}"
    ):
        return cluster.operator_token
    return service_account_token(cluster, NAMESPACE, OPERATOR_SERVICEACCOUNT)


def test_release_objects_exist(installed: KubeCluster) -> None:
    out = kubectl(installed, "get", "deploy,sa,svc,secret", "-n", NAMESPACE, "-o", "name").stdout
    for name in (
        "deployment.apps/weightroll-operator",
        "deployment.apps/vllm-example",
        "serviceaccount/weightroll-operator",
        "service/weightroll-metrics",
        "secret/vllm-example-weightroll-token",
    ):
        assert name in out.split()
    roles = kubectl(installed, "get", "clusterrole,clusterrolebinding", "-o", "name").stdout
    assert "clusterrole.rbac.authorization.k8s.io/weightroll-operator" not in roles.split()
    # HA and admission (issue 11 F, I): the Lease Role, the webhook and its certificate; the
    # operator's Role in the release namespace (issue 28 item 7).
    local = kubectl(installed, "get", "role,rolebinding,secret,svc", "-n", NAMESPACE, "-o", "name")
    for name in (
        "role.rbac.authorization.k8s.io/weightroll-operator",
        "rolebinding.rbac.authorization.k8s.io/weightroll-operator",
        "role.rbac.authorization.k8s.io/weightroll-leader-election",
        "rolebinding.rbac.authorization.k8s.io/weightroll-leader-election",
        "secret/weightroll-webhook-tls",
        "service/weightroll-webhook",
    ):
        assert name in local.stdout.split()
    hooks = kubectl(installed, "get", "validatingwebhookconfiguration", "-o", "name").stdout
    assert (
        "validatingwebhookconfiguration.admissionregistration.k8s.io/weightroll-weightupdates"
        in (hooks.split())
    )
    # Pod injection (issue 31 item 1): registered for labelled pods only, so the unlabelled
    # example pods here never reach the unroutable Service.
    hooks = kubectl(installed, "get", "mutatingwebhookconfiguration", "-o", "name").stdout
    assert "mutatingwebhookconfiguration.admissionregistration.k8s.io/weightroll-inject" in (
        hooks.split()
    )
    for verb, lease in (("get", "weightroll-operator"), ("update", "weightroll-operator")):
        allowed = kubectl(
            installed, "auth", "can-i", verb, f"leases.coordination.k8s.io/{lease}",
            "-n", NAMESPACE, f"--as=system:serviceaccount:{NAMESPACE}:{OPERATOR_SERVICEACCOUNT}",
            check=False,
        )  # fmt: skip
        assert allowed.stdout.strip() == "yes", (verb, allowed.stderr)


def test_operator_identity_matches_the_harness_token() -> None:
    assert (OPERATOR_NAMESPACE, OPERATOR_SERVICEACCOUNT) == (NAMESPACE, "weightroll-operator")


def _rules_in(installed: KubeCluster, namespace: str) -> set[tuple[str, str, str]]:
    """What the operator's identity may do in ``namespace`` (SelfSubjectRulesReview)."""
    api = kubernetes.client.AuthorizationV1Api(_api_client(installed, _operator_token(installed)))
    review = api.create_self_subject_rules_review(
        {"spec": {"namespace": namespace}}, _preload_content=False
    )
    status = yaml.safe_load(review.data)["status"]
    return {
        (group, resource, verb)
        for rule in status.get("resourceRules", [])
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def test_operator_identity_has_nothing_outside_the_release_namespace(
    installed: KubeCluster,
) -> None:
    """Issue 28 item 7: by default no pod, Secret or WeightUpdate right anywhere else."""
    assert _rules_in(installed, "default") == BASELINE
    assert _rules_in(installed, "kube-system") == BASELINE
    assert set(SAMPLE) <= _rules_in(installed, NAMESPACE)


def _allowed(api: Any, group: str, resource: str, verb: str, **attrs: str) -> bool:
    sub = resource.split("/", 1)
    body = {
        "spec": {
            "resourceAttributes": {
                "group": group,
                "resource": sub[0],
                "subresource": sub[1] if len(sub) > 1 else "",
                "verb": verb,
                **attrs,
            }
        }
    }
    review = api.create_self_subject_access_review(body, _preload_content=False)
    return bool(yaml.safe_load(review.data)["status"].get("allowed"))


def test_access_reviews(installed: KubeCluster) -> None:
    api = kubernetes.client.AuthorizationV1Api(_api_client(installed, _operator_token(installed)))
    for group, resource, verb in SAMPLE:
        assert _allowed(api, group, resource, verb, namespace=NAMESPACE), (group, resource, verb)
        assert not _allowed(api, group, resource, verb, namespace="ml"), (group, resource, verb)
        assert not _allowed(api, group, resource, verb), ("cluster-wide", group, resource, verb)
    for group, resource, verb in FORBIDDEN:
        assert not _allowed(api, group, resource, verb), (group, resource, verb)
        # the leader election Role allows creating a Lease in the release namespace
        if resource != "leases":
            assert not _allowed(api, group, resource, verb, namespace=NAMESPACE), (resource, verb)
    for group, resource, verb in UNUSED:
        assert not _allowed(api, group, resource, verb, namespace=NAMESPACE), (resource, verb)
    token = "vllm-example-weightroll-token"
    assert _allowed(api, "", "secrets", "get", namespace=NAMESPACE, name=token)
    assert not _allowed(api, "", "secrets", "get", namespace=NAMESPACE, name="other-secret")
    assert not _allowed(api, "", "secrets", "get", namespace="ml", name=token)


def test_operator_identity_reads_its_namespace_and_nothing_else(installed: KubeCluster) -> None:
    core = kubernetes.client.CoreV1Api(_api_client(installed, _operator_token(installed)))
    core.list_namespaced_pod(NAMESPACE, limit=1)
    for call in (core.list_pod_for_all_namespaces, core.list_secret_for_all_namespaces):
        with pytest.raises(kubernetes.client.ApiException) as err:
            call(limit=1)
        assert err.value.status == 403


def test_crd_installed_and_established(installed: KubeCluster) -> None:
    if not crd_available():
        pytest.skip("the generated CRD file does not exist yet")
    proc = kubectl(
        installed,
        "wait",
        "--for=condition=established",
        "--timeout=30s",
        "crd/weightupdates.weightroll.io",
    )
    assert "condition met" in proc.stdout
    ann = kubectl(
        installed,
        "get",
        "crd/weightupdates.weightroll.io",
        "-o",
        "jsonpath={.metadata.annotations.helm\\.sh/resource-policy}",
    ).stdout
    assert ann == "keep"


def test_kubectl_explain_shows_every_field_description(installed: KubeCluster) -> None:
    """``kubectl explain`` reads the CRD's descriptions (the models' attribute docstrings) as
    published by the real API server, for a nested spec field and a status field."""
    if not crd_available():
        pytest.skip("the generated CRD file does not exist yet")
    from weightroll_operator.api.crdgen import build_crd

    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    strategy = schema["properties"]["spec"]["properties"]["strategy"]["properties"]
    status = schema["properties"]["status"]["properties"]
    for path, node in (
        ("weightupdates.spec.strategy.maxUnavailable", strategy["maxUnavailable"]),
        ("weightupdates.status.abortReason", status["abortReason"]),
    ):
        deadline = time.monotonic() + 30  # the OpenAPI document is published asynchronously
        while True:
            out = kubectl(installed, "explain", path, check=False).stdout
            if "DESCRIPTION" in out or time.monotonic() > deadline:
                break
            time.sleep(1)
        # kubectl wraps the text; compare it word by word
        assert " ".join(node["description"].split()) in " ".join(out.split()), out

    # the printer columns, as `kubectl get wu` shows them
    wu = {
        "apiVersion": "weightroll.io/v1alpha1",
        "kind": "WeightUpdate",
        "metadata": {"name": "columns", "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": "nothing-selects-this"}},
            "version": "v2",
            "source": {"uri": "/models/v2"},
            "paused": True,
        },
    }
    kubectl(installed, "apply", "-f", "-", input_=yaml.safe_dump(wu))
    try:
        header = kubectl(installed, "get", "wu", "columns", "-n", NAMESPACE).stdout.splitlines()[0]
        assert header.split() == ["NAME", "PHASE", "VERSION", "UPDATED", "TOTAL", "AGE"]
        wide = kubectl(installed, "get", "wu", "columns", "-n", NAMESPACE, "-o", "wide")
        assert wide.stdout.splitlines()[0].split()[-1] == "MESSAGE"  # priority 1: -o wide only
    finally:
        kubectl(installed, "delete", "wu", "columns", "-n", NAMESPACE, "--wait=false", check=False)


def test_operator_runs_under_the_chart_serviceaccount(installed: KubeCluster) -> None:
    """`weightroll-operator` authenticated as the chart's ServiceAccount, watching the release
    namespace as the chart's Deployment does, reads the fleet, the token Secret and writes status
    and Events without a single 403 (the full rollout under this identity is the e2e tier's and
    test_rbac_audit_cluster.py's)."""
    if not crd_available():
        pytest.skip("the generated CRD file does not exist yet")
    token = _operator_token(installed)
    kubeconfig = installed.run_dir or Path(tempfile.mkdtemp())
    op_cfg = Path(kubeconfig) / "kubeconfig-operator-test"
    write_token_kubeconfig(installed.server, token, op_cfg)
    # The chart watches only its release namespace (issue 28 item 7); the token Secret there is
    # the example workload's (workload-values.yaml).
    ns = NAMESPACE
    pod_name, wu_name = f"vllm-{uuid.uuid4().hex[:6]}", f"wu-{uuid.uuid4().hex[:6]}"
    objs: list[dict[str, Any]] = [
        default_service_account(ns),
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": ns, "labels": {"app": "rbac"}},
            "spec": {
                "automountServiceAccountToken": False,
                "readinessGates": [{"conditionType": "weightroll.io/weights-ready"}],
                "containers": [{"name": "vllm", "image": "example.invalid/none"}],
            },
        },
        {
            "apiVersion": "weightroll.io/v1alpha1",
            "kind": "WeightUpdate",
            "metadata": {"name": wu_name, "namespace": ns},
            "spec": {
                "selector": {"matchLabels": {"app": "rbac"}},
                "version": "v2",
                "source": {"uri": "file:///models/v2"},
                "agent": {
                    "port": free_port(),
                    "tokenSecretRef": {"name": "vllm-example-weightroll-token"},
                },
            },
        },
    ]
    for obj in objs:
        kubectl(installed, "apply", "-f", "-", input_=yaml.safe_dump(obj))
    # The apiserver's RBAC authorizer learns new bindings from its informers a moment after the
    # chart is installed; a pod of the chart would start later than that in a real cluster.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        allowed = kubectl(
            installed,
            "auth",
            "can-i",
            "list",
            "weightupdates.weightroll.io",
            "-n",
            ns,
            "--as=system:serviceaccount:weightroll-system:weightroll-operator",
            check=False,
        )
        if allowed.stdout.strip() == "yes":
            break
        time.sleep(0.5)
    log_path = Path(kubeconfig) / f"operator-{ns}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "weightroll-operator"),
                f"--kubeconfig={op_cfg}",
                "--interval=1",
                "--metrics-port=0",
                "--health-port=0",
                f"--namespace={ns}",
            ],
            env={**os.environ, "KUBECONFIG": str(op_cfg)},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            status: dict[str, Any] = {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None:
                out = kubectl(installed, "get", "wu", wu_name, "-n", ns, "-o", "json").stdout
                status = json.loads(out).get("status") or {}
                if status.get("phase"):
                    break
                time.sleep(1)
            time.sleep(3)  # let a few passes (timer, events) run
        finally:
            proc.terminate()
            proc.wait(30)
    text = log_path.read_text()
    assert status.get("phase"), f"no status written; operator log:\n{text[-3000:]}"
    assert "replicas" in status
    assert " 403" not in text and "Forbidden" not in text, text[-3000:]
    patch = '{"metadata":{"finalizers":null}}'
    kubectl(installed, "patch", "wu", wu_name, "-n", ns, "--type=merge", "-p", patch, check=False)
    kubectl(installed, "delete", "wu", wu_name, "-n", ns, "--wait=false", check=False)
    kubectl(installed, "delete", "pod", pod_name, "-n", ns, "--wait=false", check=False)


def test_upgrade_then_uninstall_keeps_the_crd(kube_cluster: KubeCluster) -> None:
    """Last in this module: it replaces the `installed` release (same name, since the CRD's Helm
    ownership ties it to one release)."""
    if not crd_available():
        pytest.skip("the generated CRD file does not exist yet")
    config = helm_python.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=NAMESPACE)
    chart = str(CHART)
    try:
        config.uninstall(RELEASE, ignore_not_found=True)
        config.install(chart, RELEASE, {}, namespace=NAMESPACE, create_namespace=True)
        config.upgrade(chart, RELEASE, {"operator": {"verbose": True}}, namespace=NAMESPACE)
        args = kubectl(
            kube_cluster,
            "get",
            "deploy/weightroll-operator",
            "-n",
            NAMESPACE,
            "-o",
            "jsonpath={.spec.template.spec.containers[0].args}",
        ).stdout
        assert "--verbose" in args
        config.uninstall(RELEASE)
        left = kubectl(kube_cluster, "get", "crd", "-o", "name").stdout.split()
        assert "customresourcedefinition.apiextensions.k8s.io/weightupdates.weightroll.io" in left
        gone = kubectl(kube_cluster, "get", "deploy", "-n", NAMESPACE, "-o", "name").stdout
        assert "weightroll-operator" not in gone
    finally:
        config.uninstall(RELEASE, ignore_not_found=True)
        config.close()
