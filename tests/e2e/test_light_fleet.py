"""The pod simulator's kubelet contract and the chart's RBAC, with cheap pods (no vLLM).

Pods here run ``tests.harness.fake_agent_process`` (the agent's HTTP API, updates by sleeping)
through the same :class:`~weightroll_dev.devcluster.PodSimulator` as the vLLM e2e tests, so
they take about a second to start:

* the simulator writes podIP, container statuses, ``ContainersReady`` and ``Ready`` = containers
  ready AND every readiness gate True, follows gate changes and never overwrites the gate;
  scaling, deleting and restarting pods work;
* issue 5 acceptance 3: under the chart's ServiceAccount the operator completes a rollout, and
  **each rule** of the chart's ClusterRole is needed — with any one rule removed, the operator
  hits a 403 naming that rule's resource.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_dev.devcluster.apiserver import free_ports
from weightroll_dev.devcluster.operator_process import (
    launch_operator,
    stop_process,
    wait_authorized,
)
from weightroll_dev.devcluster.workload import default_service_account

from tests.e2e.conftest import GATE, NAMESPACE, RELEASE, _operator_kubeconfig
from tests.harness.apiserver import KubeCluster, kubectl

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

REPO = Path(__file__).resolve().parents[2]
TOKEN_SECRET = "light-weightroll-token"
APP = "light"


def _pod(name: str, fail: tuple[str, ...] = (), app: str = APP) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "automountServiceAccountToken": False,
            "readinessGates": [{"conditionType": GATE}],
            "containers": [
                {
                    "name": "agent",
                    "image": "example.invalid/fake-agent",
                    "command": ["python", "-m", "tests.harness.fake_agent_process"],
                    "args": [
                        "--host=0.0.0.0",
                        "--token-file=/var/run/weightroll/token",
                        f"--pod={name}",
                        *(f"--fail={v}" for v in fail),
                    ],
                    "ports": [{"name": "weightroll", "containerPort": 8470}],
                    "readinessProbe": {"httpGet": {"path": "/readyz", "port": "weightroll"}},
                    "volumeMounts": [{"name": "token", "mountPath": "/var/run/weightroll"}],
                }
            ],
            "volumes": [
                {
                    "name": "token",
                    "secret": {
                        "secretName": TOKEN_SECRET,
                        "items": [{"key": "token", "path": "token"}],
                    },
                }
            ],
        },
    }


@dataclass
class Light:
    cluster: KubeCluster
    ns: str
    sim: Any
    run: Path

    def kubectl(self, *args: str, check: bool = True, input_: str | None = None) -> str:
        return kubectl(self.cluster, *args, "-n", self.ns, check=check, input_=input_).stdout

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_=yaml.safe_dump(obj))

    def pod(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.kubectl("get", "pod", name, "-o", "json"))
        return out

    def conditions(self, name: str) -> dict[str, str]:
        return {
            c["type"]: c["status"] for c in self.pod(name).get("status", {}).get("conditions", [])
        }

    def wait(self, name: str, timeout: float = 150, **want: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            got = self.conditions(name)
            if all(got.get(k) == v for k, v in want.items()):
                return got
            assert time.monotonic() < deadline, f"{name}: want {want}, got {got}"
            time.sleep(0.3)

    def set_gate(self, name: str, status: str) -> None:
        body = {"status": {"conditions": [{"type": GATE, "status": status}]}}
        self.kubectl(
            "patch", "pod", name, "--subresource=status", "--type=strategic", "-p", json.dumps(body)
        )


@pytest.fixture(scope="module")
def chart(kube_cluster: KubeCluster) -> Iterator[KubeCluster]:
    """The chart (cluster-wide, token Secret name allowed) as release ``weightroll``."""
    if kube_cluster.external:
        pytest.skip("the pod simulator needs the built-in kube-apiserver (no kubelets)")
    from tests.charts.helpers import CHART, helm_python, with_crd_fallback

    config = helm_python.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=NAMESPACE)
    # No webhook: the dev cluster cannot route to its Service (devcluster.workload_values).
    # Cluster-wide (an explicit opt-in since issue 28): each test uses a namespace of its own.
    values = {
        "operator": {"clusterWide": True},
        "rbac": {"agentTokenSecretNames": [TOKEN_SECRET]},
        "webhook": {"enabled": False},
    }
    try:
        config.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=60)
        config.install(
            str(CHART),
            RELEASE,
            with_crd_fallback(values),
            namespace=NAMESPACE,
            create_namespace=True,
        )
        wait_authorized(kube_cluster.kubeconfig, NAMESPACE, "weightroll-operator")
        yield kube_cluster
    finally:
        config.uninstall(RELEASE, ignore_not_found=True)
        config.close()


@pytest.fixture
def light(chart: KubeCluster, tmp_path: Path) -> Iterator[Light]:
    """A fresh namespace with the token Secret, and a pod simulator for it."""
    from weightroll_dev.devcluster import PodSimulator, SimulatorConfig, SimulatorThread
    from weightroll_operator.k8s.client import KubeConfig

    ns = f"light-{uuid.uuid4().hex[:6]}"
    for obj in (
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}},
        default_service_account(ns),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": TOKEN_SECRET,
                "namespace": ns,
                "labels": {"weightroll.io/agent-token": "true"},
            },
            "stringData": {"token": "light-token"},
        },
    ):
        kubectl(chart, "apply", "-f", "-", input_=yaml.safe_dump(obj))
    sim = SimulatorThread(
        PodSimulator(
            KubeConfig.load(str(chart.kubeconfig)),
            SimulatorConfig(
                namespace=ns,
                root=tmp_path / "pods",
                env={**os.environ, "PYTHONPATH": str(REPO)},
                probe_period=0.3,
                restart_delay=0.5,
            ),
        )
    )
    sim.start()
    try:
        yield Light(chart, ns, sim, tmp_path)
    finally:
        sim.stop()
        kubectl(chart, "delete", "pods", "--all", "-n", ns, "--wait=false", check=False)


def _port_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((ip, port)) == 0


def test_ready_follows_containers_and_the_readiness_gate(light: Light) -> None:
    light.apply(_pod("p-0"))
    light.apply(_pod("p-1"))
    for name in ("p-0", "p-1"):
        got = light.wait(name, ContainersReady="True")
        assert got["Ready"] == "False"  # the gate condition is missing: counts as False
        assert GATE not in got
    ips = {light.pod(n)["status"]["podIP"] for n in ("p-0", "p-1")}
    assert len(ips) == 2 and all(ip.startswith("127.0.0.") for ip in ips)
    status = light.pod("p-0")["status"]
    assert status["phase"] == "Running"
    assert [c["ready"] for c in status["containerStatuses"]] == [True]

    light.set_gate("p-0", "True")
    light.wait("p-0", Ready="True")
    light.set_gate("p-0", "False")
    got = light.wait("p-0", Ready="False")
    assert got[GATE] == "False" and got["ContainersReady"] == "True"
    time.sleep(1.5)  # several simulator passes: the operator's condition is never overwritten
    assert light.conditions("p-0")[GATE] == "False"
    light.set_gate("p-0", "True")
    light.wait("p-0", Ready="True")


def test_restart_delete_and_scale(light: Light) -> None:
    light.apply(_pod("p-0"))
    light.wait("p-0", ContainersReady="True")
    light.set_gate("p-0", "True")
    light.wait("p-0", Ready="True")
    ip = light.pod("p-0")["status"]["podIP"]

    light.sim.call(light.sim.simulator.restart_pod, "p-0")
    # The simulated kubelet writes the restart on its next pass: until then the pod still
    # shows its Ready from before the restart.
    deadline = time.monotonic() + 60
    while (light.pod("p-0")["status"].get("containerStatuses") or [{}])[0].get("restartCount") != 1:
        assert time.monotonic() < deadline, light.pod("p-0")["status"]
        time.sleep(0.3)
    light.wait("p-0", Ready="True")

    light.apply(_pod("p-1"))  # scaling: one more pod, its own address
    light.wait("p-1", ContainersReady="True")
    assert light.pod("p-1")["status"]["podIP"] != ip

    light.kubectl("delete", "pod", "p-0")
    deadline = time.monotonic() + 20
    while _port_open(ip, 8470):
        assert time.monotonic() < deadline, "the deleted pod's agent still listens"
        time.sleep(0.2)
    assert "p-0" not in light.sim.run(lambda: set(light.sim.simulator.pods))


# ------------------------------------------------------------------------------------- RBAC


def _weightupdate(ns: str, name: str, version: str, app: str = APP) -> dict[str, Any]:
    return {
        "apiVersion": "weightroll.io/v1alpha1",
        "kind": "WeightUpdate",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "version": version,
            "source": {"uri": f"file:///models/{version}"},
            "strategy": {"maxUnavailable": 1, "updateTimeoutSeconds": 60},
            "agent": {"tokenSecretRef": {"name": TOKEN_SECRET}},
        },
    }


def _start_operator(light: Light, tag: str, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    cfg = _operator_kubeconfig(light.cluster, light.run / f"kubeconfig-{tag}")
    log = light.run / f"operator-{tag}.log"
    return launch_operator(cfg, log, free_ports(1)[0], *extra), log


def _phase(light: Light, name: str) -> str | None:
    out = light.kubectl("get", "wu", name, "-o", "json", check=False)
    return (json.loads(out).get("status") or {}).get("phase") if out else None


def test_rollout_under_the_chart_serviceaccount_succeeds(light: Light) -> None:
    """Acceptance 3 (cheap pods): the full rollout under the chart's identity, no 403."""
    for i in range(2):
        light.apply(_pod(f"p-{i}"))
    for i in range(2):
        light.wait(f"p-{i}", ContainersReady="True")
    proc, log = _start_operator(light, "full")
    try:
        light.apply(_weightupdate(light.ns, "wu", "v2"))
        deadline = time.monotonic() + 240
        while _phase(light, "wu") != "Succeeded":
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        for i in range(2):
            light.wait(f"p-{i}", Ready="True", timeout=60)
            # each pod's own Events, as `kubectl describe pod` finds them (by kind, name, uid)
            described = light.kubectl("describe", "pod", f"p-{i}")
            events = described.split("Events:", 1)[1]
            for reason in ("WeightsDrained", "WeightsUpdating", "WeightsVerified"):
                assert reason in events, described
            assert "Verified weights v2 on every rank" in " ".join(events.split()), described
        light.kubectl("delete", "wu", "wu", "--timeout=30s")
    finally:
        stop_process(proc)
    text = log.read_text()
    assert " 403" not in text and "Forbidden" not in text and "forbidden" not in text, text[-3000:]


def _rule_id(rule: dict[str, Any]) -> str:
    return f"{'/'.join(rule.get('apiGroups') or [''])}:{','.join(rule['resources'])}"


def _set_rules(cluster: KubeCluster, rules: list[dict[str, Any]]) -> None:
    patch = [{"op": "replace", "path": "/rules", "value": rules}]
    kubectl(
        cluster,
        "patch",
        "clusterrole",
        "weightroll-operator",
        "--type=json",
        "-p",
        json.dumps(patch),
    )


def _can_i(rule: dict[str, Any], ns: str) -> list[str]:
    """``kubectl auth can-i`` arguments for the first verb and resource of ``rule``."""
    resource, _, sub = rule["resources"][0].partition("/")
    group = (rule.get("apiGroups") or [""])[0]
    target = f"{resource}.{group}" if group else resource
    if rule.get("resourceNames"):
        target += f"/{rule['resourceNames'][0]}"
    user = f"system:serviceaccount:{NAMESPACE}:weightroll-operator"
    args = ["auth", "can-i", rule["verbs"][0], target, f"--as={user}", "-n", ns]
    return [*args, f"--subresource={sub}"] if sub else args


def test_every_clusterrole_rule_is_needed(light: Light) -> None:
    """Remove one rule of the chart's ClusterRole at a time: the operator gets a 403 naming
    that rule's resource while it handles a WeightUpdate."""
    role = json.loads(
        kubectl(light.cluster, "get", "clusterrole", "weightroll-operator", "-o", "json").stdout
    )
    rules: list[dict[str, Any]] = role["rules"]
    assert len(rules) >= 7
    unneeded: list[str] = []
    try:
        for i, rule in enumerate(rules):
            # A fresh pod per case: a failed case leaves its pod drained and owned.
            app = f"rule-{i}"
            light.apply(_pod(f"r-{i}", app=app))
            light.wait(f"r-{i}", ContainersReady="True")
            _set_rules(light.cluster, rules[:i] + rules[i + 1 :])
            deadline = time.monotonic() + 20
            while (
                kubectl(light.cluster, *_can_i(rule, light.ns), check=False).stdout.strip() != "no"
            ):
                assert time.monotonic() < deadline, f"rule {_rule_id(rule)} still granted"
                time.sleep(0.3)
            # Clusterwide (the default) kopf never lists namespaces: the chart grants that only
            # for a glob in operator.watchNamespaces (tests/charts/test_chart_render.py).
            proc, log = _start_operator(light, f"rule{i}")
            name = f"wu-{i}"
            needle = f'resource "{rule["resources"][0]}"'
            try:
                light.apply(_weightupdate(light.ns, name, f"v{i + 2}", app=app))
                # the operator's start (imports, kopf, first pass) on 2 loaded cores is inside
                # this; the loop ends as soon as the 403 is logged
                deadline = time.monotonic() + 90
                while needle not in log.read_text(errors="replace"):
                    if time.monotonic() > deadline or _phase(light, name) == "Succeeded":
                        unneeded.append(f"{_rule_id(rule)} (WeightUpdate {_phase(light, name)})")
                        break
                    time.sleep(0.5)
            finally:
                stop_process(proc)
                _set_rules(light.cluster, rules)
                light.kubectl(
                    "patch",
                    "wu",
                    name,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )
                light.kubectl("delete", "wu", name, "--wait=false", check=False)
                light.kubectl("delete", "pod", f"r-{i}", "--wait=false", check=False)
    finally:
        _set_rules(light.cluster, rules)
    assert not unneeded, "no 403 without these rules (not needed?): " + "; ".join(unneeded)
