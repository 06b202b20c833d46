"""Issue 28 item 7 on a real kube-apiserver: the chart's default RBAC grants exactly what the
operator uses, as the API server's audit log records it.

The expected verbs do not come from the chart (a list written next to the rules would only
repeat them): a kube-apiserver of its own runs with the audit log on
(``tests/harness/apiserver.py`` ``audited_kube_cluster``), the chart is installed with its
defaults, and ``weightroll-operator`` runs as the chart's ServiceAccount with the arguments and
environment of the chart's Deployment (so it watches what the chart tells it to). It rolls a
WeightUpdate to one version, to another and back to the first (the third rollout repeats the
pod Events of the first, which the operator counts up with ``patch``, as it does for any
repeated Event), and the WeightUpdate is deleted (finalizer). The
``(apiGroup, resource, subresource, verb)`` tuples of the ServiceAccount's resource requests in
the log must equal the tuples the rendered Roles and ClusterRoles bound to it grant: no more (an
unused grant) and no less (a 403). Every logged request must also fall inside a rule's
namespace and ``resourceNames``.

The pods are cheap fake agents (``tests.harness.fake_agent_process``) run by the pod simulator;
the webhook, the agent TLS CA and the probe ports of the Deployment are left out of the run: none
of them makes an API request.

Limitations: only what this run exercises counts as used. A verb the operator needs on a path the
run does not take shows up here as "granted but never used": extend the run to take that path
rather than adding the verb to an expected list.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_dev.devcluster.apiserver import free_ports
from weightroll_dev.devcluster.operator_process import (
    launch_operator,
    log_tail,
    stop_process,
    wait_authorized,
    write_token_kubeconfig,
)
from weightroll_dev.devcluster.workload import default_service_account

from tests.charts.helpers import (
    CHART,
    NAMESPACE,
    RELEASE,
    find,
    helm_python,
    objects,
    render,
    with_crd_fallback,
)
from tests.e2e.test_light_fleet import TOKEN_SECRET
from tests.e2e.test_light_fleet import _pod as light_pod
from tests.harness.apiserver import (
    OPERATOR_SERVICEACCOUNT,
    AuditedCluster,
    AuditedRequest,
    audited_kube_cluster,
    kubectl,
)

__all__ = ["audited_kube_cluster"]

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

REPO = Path(__file__).resolve().parents[2]
USER = f"system:serviceaccount:{NAMESPACE}:{OPERATOR_SERVICEACCOUNT}"
#: The chart's defaults; the webhook's failure policy only so that WeightUpdates are admitted by
#: an API server that cannot route to the webhook Service (no kube-proxy here).
VALUES: dict[str, Any] = {"webhook": {"failurePolicy": "Ignore"}}
APP = "audit"
PODS = ("audit-0", "audit-1")
#: Deployment env that configures no API access, or cannot work outside the pod: the webhook's
#: certificate directory, the agents' CA (the fake agents speak plain HTTP), the probe ports.
RUN_WITHOUT = {
    "WEIGHTROLL_WEBHOOK_PORT",
    "WEIGHTROLL_WEBHOOK_CERT_DIR",
    "WEIGHTROLL_AGENT_CA_FILE",
    "WEIGHTROLL_HEALTH_PORT",
    "WEIGHTROLL_METRICS_PORT",
}

Tuple = tuple[str, str, str, str]  # (apiGroup, resource, subresource, verb)


@dataclass(frozen=True, slots=True)
class Grant:
    """One rendered PolicyRule as bound to the ServiceAccount: where it holds."""

    #: The Role's namespace; ``None`` for a ClusterRole (every namespace and cluster scope).
    namespace: str | None
    rule: dict[str, Any]

    def tuples(self) -> set[Tuple]:
        out: set[Tuple] = set()
        for group in self.rule.get("apiGroups", []):
            for full in self.rule.get("resources", []):
                resource, _, sub = full.partition("/")
                out |= {(group, resource, sub, verb) for verb in self.rule.get("verbs", [])}
        return out

    def allows(self, req: AuditedRequest) -> bool:
        if (req.group, req.resource, req.subresource, req.verb) not in self.tuples():
            return False
        if self.namespace is not None and req.namespace != self.namespace:
            return False
        names = self.rule.get("resourceNames")
        return not names or req.name in names


def _grants(objs: list[dict[str, Any]]) -> list[Grant]:
    """The rules of every rendered Role/ClusterRole bound to the operator's ServiceAccount."""
    subject = {"kind": "ServiceAccount", "name": OPERATOR_SERVICEACCOUNT, "namespace": NAMESPACE}
    roles = {
        (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objs
        if o["kind"] in ("Role", "ClusterRole")
    }
    out: list[Grant] = []
    for binding in objs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if subject not in binding.get("subjects", []):
            continue
        ns = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role = roles[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        out.extend(Grant(ns, rule) for rule in role["rules"])
    return out


def _fmt(tuples: set[Tuple]) -> str:
    return ", ".join(
        f"{verb} {group + '/' if group else ''}{res}{'/' + sub if sub else ''}"
        for group, res, sub, verb in sorted(tuples)
    )


@dataclass
class Release:
    audited: AuditedCluster
    run: Path
    sim: Any

    def kubectl(self, *args: str, check: bool = True, input_: str | None = None) -> str:
        cluster = self.audited.cluster
        return kubectl(cluster, *args, "-n", NAMESPACE, check=check, input_=input_).stdout

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_=yaml.safe_dump(obj))

    def conditions(self, pod: str) -> dict[str, str]:
        out = json.loads(self.kubectl("get", "pod", pod, "-o", "json"))
        return {c["type"]: c["status"] for c in out.get("status", {}).get("conditions", [])}

    def wu(self, name: str) -> dict[str, Any] | None:
        out = self.kubectl("get", "wu", name, "-o", "json", "--ignore-not-found")
        return json.loads(out) if out.strip() else None


@pytest.fixture(scope="module")
def release(
    audited_kube_cluster: AuditedCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Release]:
    """The chart with its defaults on the audited apiserver, the token Secret, a pod simulator."""
    from weightroll_dev.devcluster import PodSimulator, SimulatorConfig, SimulatorThread
    from weightroll_operator.k8s.client import KubeConfig

    cluster = audited_kube_cluster.cluster
    run = tmp_path_factory.mktemp("rbac-audit")
    config = helm_python.Config(kubeconfig_path=str(cluster.kubeconfig), namespace=NAMESPACE)
    sim = SimulatorThread(
        PodSimulator(
            KubeConfig.load(str(cluster.kubeconfig)),
            SimulatorConfig(
                namespace=NAMESPACE,
                root=run / "pods",
                label_selector=f"app={APP}",
                env={**os.environ, "PYTHONPATH": str(REPO)},
                probe_period=0.3,
                restart_delay=0.5,
            ),
        )
    )
    try:
        config.install(
            str(CHART), RELEASE, with_crd_fallback(VALUES), namespace=NAMESPACE,
            create_namespace=True,
        )  # fmt: skip
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": TOKEN_SECRET,
                "namespace": NAMESPACE,
                "labels": {"weightroll.io/agent-token": "true"},
            },
            "stringData": {"token": "audit-token-not-secret"},
        }
        for obj in (default_service_account(NAMESPACE), secret):
            kubectl(cluster, "apply", "-f", "-", input_=yaml.safe_dump(obj))
        assert wait_authorized(cluster.kubeconfig, NAMESPACE, OPERATOR_SERVICEACCOUNT)
        sim.start()
        yield Release(audited_kube_cluster, run, sim)
    finally:
        sim.stop()
        config.uninstall(RELEASE, ignore_not_found=True)
        config.close()


def _operator_command(objs: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """Arguments and environment of the chart's operator container, as it would run."""
    deploy = find(objs, "Deployment", "weightroll-operator")
    (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
    assert ctr["command"] == ["weightroll-operator"]
    env = {e["name"]: e["value"] for e in ctr["env"] if "value" in e}
    env = {k: v for k, v in env.items() if k not in RUN_WITHOUT}
    # The downward API fields of the Deployment.
    env |= {"POD_NAMESPACE": NAMESPACE, "POD_NAME": "weightroll-operator-audit"}
    return list(ctr.get("args", [])), env


def _weightupdate(version: str) -> dict[str, Any]:
    return {
        "apiVersion": "weightroll.io/v1alpha1",
        "kind": "WeightUpdate",
        "metadata": {"name": "wu-audit", "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": APP}},
            "version": version,
            "source": {"uri": f"file:///models/{version}"},
            "strategy": {"maxUnavailable": 1, "updateTimeoutSeconds": 60},
            "agent": {"tokenSecretRef": {"name": TOKEN_SECRET}},
        },
    }


def _wait_succeeded(rel: Release, proc: Any, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        body = rel.wu("wu-audit") or {}
        status = body.get("status") or {}
        current = status.get("observedGeneration") == body.get("metadata", {}).get("generation")
        if current and status.get("phase") == "Succeeded":
            return
        assert proc.poll() is None, log_tail(log)
        assert time.monotonic() < deadline, f"{json.dumps(status)[:2000]}\n{log_tail(log)}"
        time.sleep(0.5)


def test_default_rbac_grants_exactly_what_a_rollout_and_a_deletion_use(release: Release) -> None:
    objs = objects(render(VALUES))
    grants = _grants(objs)
    args, env = _operator_command(objs)
    for pod in PODS:
        release.apply(light_pod(pod, app=APP))
    deadline = time.monotonic() + 120
    while not all(release.conditions(p).get("ContainersReady") == "True" for p in PODS):
        assert time.monotonic() < deadline, "the fake agent pods never started"
        time.sleep(0.3)

    cluster = release.audited.cluster
    assert cluster.operator_token and cluster.operator_user == USER
    cfg = write_token_kubeconfig(cluster.server, cluster.operator_token, release.run / "kc")
    log = release.run / "operator.log"
    since = release.audited.mark()
    proc = launch_operator(cfg, log, free_ports(1)[0], *args, env=env)
    try:
        for version in ("v2", "v3", "v2"):
            release.apply(_weightupdate(version))
            _wait_succeeded(release, proc, log)
        release.kubectl("delete", "wu", "wu-audit", "--wait=false")
        deadline = time.monotonic() + 60
        while release.wu("wu-audit") is not None:  # the operator removes its finalizer
            assert proc.poll() is None and time.monotonic() < deadline, log_tail(log)
            time.sleep(0.5)
    finally:
        stop_process(proc)  # a clean stop also hands the Lease back (an update)
    time.sleep(1)

    requests = release.audited.requests(USER, since)
    assert requests, "no request of the operator's ServiceAccount in the audit log"
    refused = [r for r in requests if r.code in (401, 403)]
    assert not refused, f"refused: {refused}\n{log_tail(log)}"
    used = {(r.group, r.resource, r.subresource, r.verb) for r in requests}
    granted = set().union(*(g.tuples() for g in grants))
    assert used == granted, (
        f"granted but never used: {_fmt(granted - used) or '-'}; "
        f"used but not granted: {_fmt(used - granted) or '-'}"
    )
    outside = [r for r in requests if not any(g.allows(r) for g in grants)]
    assert not outside, f"outside every rule's namespace or resourceNames: {outside}"
    # Roles only by default: nothing cluster-wide, nothing outside the release namespace.
    assert all(g.namespace == NAMESPACE for g in grants), grants


def test_audit_log_records_refused_requests_too(release: Release) -> None:
    """The comparison above would see a request the chart does not grant: a refused request is
    in the log with its 403, under the ServiceAccount's name (not an impersonating admin's)."""
    cluster = release.audited.cluster
    assert cluster.operator_kubeconfig is not None
    since = release.audited.mark()
    denied = kubectl(
        cluster, "get", "pod", "nobody", "-n", NAMESPACE, kubeconfig=cluster.operator_kubeconfig,
        check=False,
    )  # fmt: skip
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower(), denied.stderr
    kubectl(cluster, "get", "pods", "-n", NAMESPACE)  # admin: not the ServiceAccount's
    deadline = time.monotonic() + 10
    while not (requests := release.audited.requests(USER, since)):
        assert time.monotonic() < deadline, "the refused request is not in the audit log"
        time.sleep(0.2)
    assert [(r.verb, r.resource, r.name, r.code) for r in requests] == [
        ("get", "pods", "nobody", 403)
    ]
