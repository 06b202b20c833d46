"""One local dev cluster: what ``weightroll_dev dev up`` starts, ``make demo`` shows, e2e uses.

:func:`up` runs the one bring-up in a detached *supervisor* process (its own session, output in
``DIR/dev.log``) and returns when every pod is Ready:

1. etcd + kube-apiserver 1.20.2 (:mod:`.apiserver`) on free loopback ports;
2. checkpoints ``v1`` (what the pods boot), ``v2`` and ``v3``, each with its weightroll manifest,
   in the pods' persistent volume ``DIR/pv-models`` (trained tiny llamas that answer the demo's
   prompt with one sentence per version, :mod:`weightroll_dev.demomodels`);
3. the chart (release ``weightroll`` in ``weightroll-system``) with its example workload;
4. ``weightroll-operator`` as a process authenticated as the chart's ServiceAccount; with
   ``--inject`` it also serves the admission webhooks on loopback, the chart's webhook
   configurations are pointed at it, and the example's pods carry only the inject label;
5. ``--pods N`` pods from the workload's Deployment template, run by the kubelet stand-in
   (:mod:`.kubelet`): each a real vLLM CPU server plus ``weightroll-agent`` on its own loopback
   IP, admitted into traffic by the operator (Ready) on their boot weights.

Then the supervisor writes ``DIR/cluster.json`` (:class:`ClusterInfo`: kubeconfig, namespace,
selector, tokenSecret, checkpoints as a WeightUpdate names them, pods -> vLLM OpenAI base URL)
and keeps everything running, linking checkpoints published into the persistent volume later
into every pod's node-local copy once a second, until :func:`down` (or SIGTERM) stops it.

Invariants:
    * Everything started carries ``WEIGHTROLL_DEV_DIR=DIR`` in its environment (the supervisor
      sets it; etcd, the apiserver, the operator and every container inherit it), so
      :func:`down` finds and stops whatever the supervisor could not, even after a SIGKILL.
    * ``cluster.json`` exists only while the cluster is up and Ready; it is written atomically.
    * The supervisor imports neither torch nor vLLM: checkpoints are built by a child Python.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from weightroll_dev import checkout_pythonpath
from weightroll_dev.demo_view import condition
from weightroll_dev.devcluster.apiserver import (
    BUILD_HINT,
    OPERATOR_NAMESPACE,
    REPO,
    SCRIPT,
    KubeCluster,
    apiserver_binary,
    free_ports,
    run_kubectl,
    start_apiserver,
    stop_apiserver,
)
from weightroll_dev.devcluster.operator_process import (
    log_tail,
    start_operator,
    stop_process,
    wait_authorized,
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

__all__ = [
    "CLUSTER_JSON",
    "ENV_MARKER",
    "ClusterInfo",
    "DevError",
    "Options",
    "down",
    "ensure_apiserver",
    "leftovers",
    "up",
]

NAMESPACE = OPERATOR_NAMESPACE
RELEASE = "weightroll"
#: The agents' bearer token (the chart's example Secret); a dev cluster on loopback only.
TOKEN = "dev-token-not-secret"
MANIFEST = "weightroll-manifest.json"
BOOT = "v1"
VERSIONS = ("v1", "v2", "v3")
CLUSTER_JSON = "cluster.json"
PID_FILE = "supervisor.pid"
LOG_FILE = "dev.log"
#: Environment variable naming the dev directory in every process a dev cluster starts.
ENV_MARKER = "WEIGHTROLL_DEV_DIR"
#: Name (and ``app.kubernetes.io/name``) of a reference pod: vLLM alone, cold on a checkpoint.
REFERENCE_POD = "vllm-cold"
CHART = REPO / "charts" / "weightroll"
CRD_FILE = CHART / "files" / "crds" / "weightupdates.weightroll.io.yaml"
VLLM_PORT = 8000
AGENT_PORT = 8470

Say = Callable[[str], None]


class DevError(RuntimeError):
    """The dev cluster could not be started or stopped; the message says why."""


@dataclass(frozen=True, slots=True)
class Options:
    """What :func:`up` starts."""

    #: Directory of the cluster: ``cluster.json``, logs, kube state, volumes, pods.
    dir: Path
    #: Pods of the example workload.
    pods: int = 3
    #: Pod IPs are ``127.0.0.<first_ip>`` and up (two dev clusters on one machine: apart).
    first_ip: int = 10
    #: Also start a reference pod (:data:`REFERENCE_POD`) booting this version cold.
    reference: str | None = None
    #: Seconds allowed for the pods to become Ready (0: 160 s per pod, at least 300).
    timeout: float = 0
    #: Prepare the pods with the operator's injection webhook: the example workload carries
    #: only the ``weightroll.io/inject`` label; the chart's webhook configurations are pointed
    #: at the local operator process (this API server routes no Service traffic).
    inject: bool = False

    def pod_timeout(self) -> float:
        return self.timeout or max(300.0, 160.0 * self.pods)


@dataclass(frozen=True, slots=True)
class ClusterInfo:
    """``DIR/cluster.json``: how to reach a running dev cluster (the documented keys first)."""

    kubeconfig: str
    namespace: str
    #: matchLabels selecting the workload's pods (a WeightUpdate's ``spec.selector``).
    selector: dict[str, str]
    #: Secret holding the agents' token (a WeightUpdate's ``spec.agent.tokenSecretRef.name``).
    tokenSecret: str
    #: version -> {"uri": source URI, "manifest": manifest URI} as a WeightUpdate names them,
    #: plus "path": the checkpoint's directory on this machine.
    checkpoints: dict[str, dict[str, str]]
    #: pod -> vLLM OpenAI base URL reachable from this machine (``http://127.0.0.N:8000/v1``).
    pods: dict[str, str]
    #: pod -> its agent's base URL (``http://127.0.0.N:8470``; bearer :attr:`agentToken`).
    agents: dict[str, str]
    agentToken: str
    servedModel: str
    #: Reference pods (no agent, no gate) -> vLLM OpenAI base URL.
    references: dict[str, str]
    #: pod -> directory of its node-local copy of the checkpoint volume (``/models``).
    podVolumes: dict[str, str]
    persistentVolume: str
    operatorMetricsUrl: str
    operatorLog: str
    operatorPid: int
    supervisorPid: int
    dir: str
    server: str = ""

    @classmethod
    def load(cls, directory: Path) -> ClusterInfo:
        """Read ``directory/cluster.json``.

        Raises:
            DevError: there is none (no dev cluster is up there).
        """
        path = Path(directory) / CLUSTER_JSON
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise DevError(f"no dev cluster is up in {directory} ({path} is missing)") from None
        return cls(**data)

    def write(self) -> None:
        path = Path(self.dir) / CLUSTER_JSON
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    def kubectl(self, *args: str, input_: str | None = None, check: bool = True) -> str:
        """``kubectl --kubeconfig=<admin> ARGS``; raises :class:`DevError` on failure."""
        proc = run_kubectl(Path(self.kubeconfig), *args, input_=input_)
        if check and proc.returncode != 0:
            raise DevError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_=yaml.safe_dump(obj))

    def host(self, pod: str) -> str:
        """The pod's IP (reachable from this machine)."""
        url = self.pods.get(pod) or self.references[pod]
        return str(urllib.parse.urlsplit(url).hostname)

    def operator_alive(self) -> bool:
        return _alive(self.operatorPid)

    def operator_log_tail(self, lines: int = 40) -> str:
        return log_tail(Path(self.operatorLog), lines)

    def weightupdate(
        self, name: str, version: str, *, on_failure: str = "Halt", **strategy: Any
    ) -> dict[str, Any]:
        """A WeightUpdate rolling ``version`` through the workload (one pod at a time)."""
        return {
            "apiVersion": "weightroll.io/v1alpha1",
            "kind": "WeightUpdate",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "selector": {"matchLabels": dict(self.selector)},
                "version": version,
                "source": {
                    "uri": self.checkpoints[version]["uri"],
                    "manifest": self.checkpoints[version]["manifest"],
                },
                "strategy": {
                    "maxUnavailable": 1,
                    "onFailure": on_failure,
                    "updateTimeoutSeconds": 120,
                    "drain": {"mode": "wait", "timeoutSeconds": 10},
                    **strategy,
                },
                "agent": {"tokenSecretRef": {"name": self.tokenSecret}},
            },
        }

    def corrupt(self, pod: str, version: str) -> Path:
        """Flip one byte of tensor data in ``pod``'s node-local copy of ``version`` only."""
        return corrupt_tensor_file(Path(self.podVolumes[pod]) / version)

    def publish(self, version: str, seed: int, timeout: float = 120) -> ClusterInfo:
        """Write one more checkpoint (+ manifest) into the persistent volume and wait until every
        pod's copy has it (the supervisor links it in); returns the info naming it."""
        pv = Path(self.persistentVolume)
        _build_checkpoints(pv, (BOOT, version), seeds={version: seed})
        deadline = time.monotonic() + timeout
        while not all((Path(v) / version / MANIFEST).is_file() for v in self.podVolumes.values()):
            if time.monotonic() > deadline or not _alive(self.supervisorPid):
                raise DevError(f"{version} did not reach every pod's volume in {timeout}s")
            time.sleep(0.5)
        checkpoints = {**self.checkpoints, version: _checkpoint(pv, version)}
        info = ClusterInfo(**{**asdict(self), "checkpoints": checkpoints})
        return info


# ---------------------------------------------------------------------- helpers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is gone for our purposes.
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0] != "Z"
    return True


def _checkpoint(pv: Path, version: str) -> dict[str, str]:
    return {
        "uri": f"file:///models/{version}",
        "manifest": f"file:///models/{version}/{MANIFEST}",
        "path": str(pv / version),
    }


def _build_checkpoints(pv: Path, versions: Sequence[str], seeds: dict[str, int]) -> None:
    """``versions`` (+ manifests) into ``pv`` by a child Python (torch stays out of here)."""
    argv = [sys.executable, "-m", "weightroll_dev.demomodels", str(pv), *versions]
    argv += ["--manifest", MANIFEST, *(f"--seed={v}={s}" for v, s in seeds.items())]
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise DevError(f"building checkpoints {versions} failed:\n{proc.stderr.strip()[-3000:]}")


def leftovers(directory: Path) -> list[int]:
    """PIDs of live processes a dev cluster in ``directory`` started (by :data:`ENV_MARKER`)."""
    want = f"{ENV_MARKER}={Path(directory).resolve()}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in environ and _alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def _run_streamed(cmd: list[str], what: str, say: Say) -> None:
    say(f"{what}: {' '.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        say(f"    {line.rstrip()}")
    if proc.wait() != 0:
        raise DevError(f"{' '.join(cmd)} failed (exit {proc.returncode}); see its output above")


def ensure_apiserver(say: Say) -> None:
    """The local kube-apiserver binary, etcd and kubectl: present, or installed/built now.

    Raises:
        DevError: a tool is missing and cannot be installed here (not root).
    """
    if apiserver_binary() is not None and shutil.which("etcd") and shutil.which("kubectl"):
        return
    if not (shutil.which("go") and shutil.which("etcd") and shutil.which("kubectl")):
        if os.geteuid() != 0:
            raise DevError(
                "go, etcd or kubectl is missing; run `sudo bash scripts/system-deps.sh`, "
                "then this command again"
            )
        _run_streamed(
            ["bash", str(REPO / "scripts" / "system-deps.sh")],
            "Installing the system packages (go, etcd, kubectl)",
            say,
        )
    if apiserver_binary() is None:
        _run_streamed(
            ["bash", str(SCRIPT), "build"],
            "Building kube-apiserver 1.20.2 once (≈4-6 min on 2 cores, cached afterwards)",
            say,
        )
    if apiserver_binary() is None:
        raise DevError(f"kube-apiserver 1.20.2 is not built: {BUILD_HINT}")


# ---------------------------------------------------------------------- the supervisor


class _Stop(BaseException):
    """SIGTERM: stop everything."""


class _Supervisor:
    """Starts the cluster (see the module docstring), serves it, stops it."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.dir = opts.dir
        self.pv = self.dir / "pv-models"
        self.cluster: KubeCluster | None = None
        self.sim: Any = None  # kubelet.SimulatorThread
        self.operator: subprocess.Popen[bytes] | None = None
        self.names = tuple(f"{WORKLOAD}-{i}" for i in range(opts.pods))
        self.metrics_url = ""
        self._build_error: Exception | None = None

    def say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    def kubectl(self, *args: str, input_: str | None = None) -> str:
        assert self.cluster is not None
        proc = run_kubectl(self.cluster.kubeconfig, *args, input_=input_)
        if proc.returncode != 0:
            raise DevError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def apply(self, obj: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input_=yaml.safe_dump(obj))

    def start(self) -> ClusterInfo:
        versions = list(VERSIONS)
        if self.opts.reference and self.opts.reference not in versions:
            versions.append(self.opts.reference)
        self.say(f"Building checkpoints {', '.join(versions)} with manifests (cached after once)")
        began = time.monotonic()
        builder = threading.Thread(
            target=self._build, args=(versions,), name="checkpoints", daemon=True
        )
        builder.start()
        self.say("Starting etcd + kube-apiserver on 127.0.0.1")
        self.cluster = start_apiserver(_mkdir(self.dir / "kube"))
        self.say(f"apiserver {self.cluster.server} (kubeconfig {self.cluster.kubeconfig})")
        self._install_chart()
        self._start_simulator()
        self._start_operator()
        builder.join()
        if self._build_error is not None:
            raise self._build_error
        self.say(f"checkpoints ready in {self.pv} ({time.monotonic() - began:.0f}s)")
        self._start_pods()
        pods = self._wait_ready()
        return self._info(pods)

    def _build(self, versions: list[str]) -> None:
        try:
            _build_checkpoints(self.pv, versions, seeds={})
        except Exception as e:  # reported by start()
            self._build_error = e

    def _install_chart(self) -> None:
        import helm_python

        assert self.cluster is not None
        self.say("Installing the chart (helm-python-sdk): CRD, operator RBAC, workload")
        values = workload_values(BOOT, TOKEN, replicas=self.opts.pods, inject=self.opts.inject)
        if not CRD_FILE.is_file():
            values = {**values, "installCRDs": False}
        config = helm_python.Config(
            kubeconfig_path=str(self.cluster.kubeconfig), namespace=NAMESPACE
        )
        try:
            config.install(str(CHART), RELEASE, values, namespace=NAMESPACE, create_namespace=True)
        finally:
            config.close()
        # The built-in apiserver has no controller-manager: create the default ServiceAccount.
        self.apply(default_service_account(NAMESPACE))

    def _start_simulator(self) -> None:
        from weightroll_operator.k8s.client import KubeConfig

        from weightroll_dev.devcluster import PodSimulator, SimulatorConfig, SimulatorThread

        assert self.cluster is not None
        self.pv.mkdir(parents=True, exist_ok=True)
        self.sim = SimulatorThread(
            PodSimulator(
                KubeConfig.load(str(self.cluster.kubeconfig)),
                SimulatorConfig(
                    namespace=NAMESPACE,
                    root=self.dir / "pods",
                    volumes={"vllm-models": self.pv},
                    env=engine_env(BOOT),
                    first_ip=self.opts.first_ip,
                ),
            )
        )
        self.sim.start()

    def _start_operator(self) -> None:
        assert self.cluster is not None and self.cluster.operator_kubeconfig is not None
        self.say("Starting `weightroll-operator` as the chart's ServiceAccount")
        wait_authorized(self.cluster.kubeconfig, NAMESPACE, "weightroll-operator")
        extra: list[str] = []
        env: dict[str, str] = {}
        if self.opts.inject:
            extra, env = self._webhook_settings()
        try:
            running = start_operator(
                self.cluster.operator_kubeconfig,
                self.dir / "operator.log",
                *extra,
                new_session=True,
                env=env,
            )
        except RuntimeError as e:
            raise DevError(str(e)) from None
        self.operator = running.process
        self.metrics_url = running.metrics_url
        self.say(f"operator up (metrics {self.metrics_url}, log {running.log})")
        if self.opts.inject:
            self._point_webhooks_here(int(extra[0].split("=")[1]))

    def _webhook_settings(self) -> tuple[list[str], dict[str, str]]:
        """The operator's webhook flags and the chart's ``WEIGHTROLL_INJECT_*`` settings (read
        from the installed operator Deployment, which this cluster never runs)."""
        certs = _mkdir(self.dir / "webhook")
        loopback_certificates(certs)
        selector = "app.kubernetes.io/component=operator"
        found = self.kubectl("get", "deploy", "-n", NAMESPACE, "-l", selector, "-o", "json")
        deploy = json.loads(found)["items"][0]
        (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
        env = {
            e["name"]: e["value"]
            for e in ctr["env"]
            if e["name"].startswith("WEIGHTROLL_INJECT_") and "value" in e
        }
        env["WEIGHTROLL_WEBHOOK_ADDR"] = "127.0.0.1"
        (port,) = free_ports(1)
        return [f"--webhook-port={port}", f"--webhook-cert-dir={certs}"], env

    def _point_webhooks_here(self, port: int) -> None:
        """Re-point the chart's webhook configurations at the local operator (loopback URL and
        the local CA), then wait until the API server calls the pod-injection webhook."""
        ca = base64.b64encode((self.dir / "webhook" / "ca.crt").read_bytes()).decode()
        hooks = (
            ("validatingwebhookconfiguration", f"{RELEASE}-weightupdates", "validate"),
            ("mutatingwebhookconfiguration", f"{RELEASE}-inject", "mutate"),
        )
        for kind, name, path in hooks:
            client = {"url": f"https://127.0.0.1:{port}/{path}", "caBundle": ca}
            patch = [{"op": "replace", "path": "/webhooks/0/clientConfig", "value": client}]
            self.kubectl("patch", kind, name, "--type=json", "-p", json.dumps(patch))
        probe = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "inject-probe",
                "namespace": NAMESPACE,
                "labels": {"weightroll.io/inject": "true"},
            },
            "spec": {"containers": [{"name": "probe", "image": "none"}]},
        }
        deadline = time.monotonic() + 30
        assert self.cluster is not None
        while True:
            proc = run_kubectl(
                self.cluster.kubeconfig, "create", "-f", "-", input_=yaml.safe_dump(probe)
            )
            if "vLLM container not found" in proc.stderr:
                self.say("pod-injection webhook answering (the chart's, at the local operator)")
                return
            if proc.returncode == 0:
                self.kubectl("delete", "pod", "inject-probe", "-n", NAMESPACE, "--wait=false")
            if time.monotonic() > deadline:
                raise DevError(f"the pod-injection webhook was never called: {proc.stderr}")
            time.sleep(0.5)

    def _start_pods(self) -> None:
        self.say(
            f"Starting {len(self.names)} pods, each a real vLLM CPU server + the agent "
            "(≈1-4 min on 2 cores)"
        )
        deploy = json.loads(self.kubectl("get", "deploy", WORKLOAD, "-n", NAMESPACE, "-o", "json"))
        for pod in pods_from_deployment(deploy, self.names, NAMESPACE):
            self.apply(pod)
        if self.opts.reference:
            self.apply(self._reference_pod(deploy, self.opts.reference))

    def _reference_pod(self, deploy: dict[str, Any], version: str) -> dict[str, Any]:
        """The workload's vLLM container alone, booting ``version`` (no agent, no gate)."""
        template = deploy["spec"]["template"]["spec"]
        vllm = next(c for c in template["containers"] if c["name"] == "vllm")
        boot = f"/models/{BOOT}"
        vllm = {**vllm, "args": [f"/models/{version}" if a == boot else a for a in vllm["args"]]}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": REFERENCE_POD,
                "namespace": NAMESPACE,
                "labels": {"app.kubernetes.io/name": REFERENCE_POD},
            },
            "spec": {**template, "containers": [vllm], "readinessGates": []},
        }

    def _wait_ready(self) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + self.opts.pod_timeout()
        shown: dict[str, str] = {}
        while True:
            items = json.loads(self.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json"))["items"]
            pods = {p["metadata"]["name"]: p for p in items}
            for name in self.names:
                row = _pod_row(pods.get(name, {}))
                if shown.get(name) != row:
                    shown[name] = row
                    self.say(f"{name:<16} {row}")
            if all(condition(pods.get(n, {}), "Ready") == "True" for n in self.names):
                return pods
            if self.operator is not None and self.operator.poll() is not None:
                raise DevError(f"the operator exited: {log_tail(self.dir / 'operator.log')}")
            if time.monotonic() > deadline:
                raise DevError(f"pods not Ready after {self.opts.pod_timeout():.0f}s: {shown}")
            time.sleep(1)

    def _info(self, pods: dict[str, dict[str, Any]]) -> ClusterInfo:
        assert self.cluster is not None and self.operator is not None
        ips = {n: str(pods[n]["status"]["podIP"]) for n in self.names}
        references = {}
        if self.opts.reference:
            ip = self.sim.run(lambda: self.sim.simulator.pod_ip(REFERENCE_POD))
            references[REFERENCE_POD] = f"http://{ip}:{VLLM_PORT}/v1"
        versions = sorted(p.name for p in self.pv.iterdir() if (p / MANIFEST).is_file())
        return ClusterInfo(
            kubeconfig=str(self.cluster.kubeconfig),
            namespace=NAMESPACE,
            selector={"app.kubernetes.io/name": WORKLOAD},
            tokenSecret=TOKEN_SECRET,
            checkpoints={v: _checkpoint(self.pv, v) for v in versions},
            pods={n: f"http://{ip}:{VLLM_PORT}/v1" for n, ip in ips.items()},
            agents={n: f"http://{ip}:{AGENT_PORT}" for n, ip in ips.items()},
            agentToken=TOKEN,
            servedModel=SERVED_MODEL,
            references=references,
            podVolumes={
                n: str(self.sim.run(lambda n=n: self.sim.simulator.volume_path(n, "models")))
                for n in self.names
            },
            persistentVolume=str(self.pv),
            operatorMetricsUrl=self.metrics_url,
            operatorLog=str(self.dir / "operator.log"),
            operatorPid=self.operator.pid,
            supervisorPid=os.getpid(),
            dir=str(self.dir),
            server=self.cluster.server,
        )

    def serve(self, stop: threading.Event) -> None:
        """Until ``stop``: link newly published checkpoints into every pod's volume copy."""
        reported = False
        while not stop.wait(1.0):
            self.sim.run(self.sim.simulator.sync_volumes)
            if not reported and self.operator is not None and self.operator.poll() is not None:
                reported = True
                self.say(f"the operator exited: {log_tail(self.dir / 'operator.log')}")

    def close(self) -> None:
        """Stop everything started, newest first; each step runs even if another fails."""
        self.say("Stopping: operator, pods, kube-apiserver, etcd")
        with contextlib.suppress(FileNotFoundError):
            (self.dir / CLUSTER_JSON).unlink()
        if self.operator is not None:
            stop_process(self.operator)
        if self.sim is not None:
            try:
                self.sim.stop()
            except Exception as e:  # keep going: the apiserver must stop too
                self.say(f"pod simulator stop: {e}")
        if self.cluster is not None and self.cluster.run_dir is not None:
            stop_apiserver(self.cluster.run_dir)
        self.say("stopped")


def loopback_certificates(directory: Path) -> bytes:
    """A CA (``ca.crt``) and a serving certificate for 127.0.0.1 (``tls.crt``, ``tls.key``) in
    ``directory``; returns the CA's PEM (a webhook configuration's ``caBundle``)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "7", "-subj",
            "/CN=weightroll-dev-ca", "-keyout", "ca.key", "-out", "ca.crt")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
            "-keyout", "tls.key", "-out", "tls.csr")  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "7", "-extfile", "san.ext", "-out", "tls.crt")  # fmt: skip
    return (directory / "ca.crt").read_bytes()


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _pod_row(pod: dict[str, Any]) -> str:
    status = pod.get("status", {})
    cs = status.get("containerStatuses") or []
    up = sum(1 for c in cs if c.get("ready"))
    if condition(pod, "Ready") == "True":
        what = f"Ready: admitted by the operator, serving {BOOT}"
    elif cs and up == len(cs):
        what = f"vLLM serving, agent verified {BOOT}; operator admitting"
    else:
        what = "starting"
    ip = status.get("podIP", "-")
    return f"{status.get('phase', 'Pending'):<8} ip={ip:<12} containers {up}/{len(cs) or 2} {what}"


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def supervise(argv: Sequence[str] | None = None) -> int:
    """The supervisor's entry point (``python -m weightroll_dev.devcluster.bringup``)."""
    p = argparse.ArgumentParser(prog="weightroll-dev-supervisor")
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--pods", type=int, default=3)
    p.add_argument("--first-ip", type=int, default=10)
    p.add_argument("--reference")
    p.add_argument("--timeout", type=float, default=0)
    p.add_argument("--inject", action="store_true")
    a = p.parse_args(argv)
    opts = Options(a.dir.resolve(), a.pods, a.first_ip, a.reference, a.timeout, a.inject)
    os.environ[ENV_MARKER] = str(opts.dir)  # inherited by everything started from here
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)
    (opts.dir / PID_FILE).write_text(f"{os.getpid()}\n")
    sup = _Supervisor(opts)
    stop = threading.Event()
    code = 0
    try:
        info = sup.start()
        info.write()
        sup.say(f"Ready: {len(info.pods)} pods; {opts.dir / CLUSTER_JSON}")
        sup.serve(stop)
    except _Stop:
        sup.say("SIGTERM")
    except Exception as e:
        sup.say(f"FAILED: {type(e).__name__}: {e}")
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut cleanup
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sup.close()
    return code


# ---------------------------------------------------------------------- up / down

#: Supervisors started by this process (reaped by :func:`down`).
_SPAWNED: dict[Path, subprocess.Popen[bytes]] = {}


def _read_pid(directory: Path) -> int | None:
    try:
        return int((directory / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _ours(pid: int, directory: Path) -> bool:
    """Whether ``pid`` is alive and a process of the dev cluster in ``directory`` (a stale PID
    file may name a PID that now belongs to something else, which must never be signalled)."""
    return _alive(pid) and pid in leftovers(directory)


@contextlib.contextmanager
def _following(log: Path, offset: int, say: Say) -> Iterator[Callable[[], None]]:
    """Yields a function that prints the lines added to ``log`` (from ``offset``) since the last
    call."""
    with log.open("a+") as fh:
        fh.seek(offset)

        def pump() -> None:
            for line in fh.readlines():
                say(line.rstrip("\n"))

        yield pump


def up(opts: Options, say: Say = print) -> ClusterInfo:
    """Start a dev cluster in ``opts.dir`` (see the module docstring); returns once every pod is
    Ready, with the cluster left running in the background.

    Raises:
        DevError: a prerequisite is missing, a cluster already runs there, or a step failed
            (the message carries the log tail; everything started is stopped again).
    """
    directory = opts.dir.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    pid = _read_pid(directory)
    if pid is not None and _ours(pid, directory):
        raise DevError(
            f"a dev cluster already runs in {directory} (supervisor {pid}); "
            f"stop it first: python -m weightroll_dev dev down --dir {directory}"
        )
    ensure_apiserver(say)
    with contextlib.suppress(FileNotFoundError):
        (directory / CLUSTER_JSON).unlink()
    log = directory / LOG_FILE
    offset = log.stat().st_size if log.exists() else 0
    argv = [sys.executable, "-m", "weightroll_dev.devcluster.bringup", f"--dir={directory}"]
    argv += [f"--pods={opts.pods}", f"--first-ip={opts.first_ip}", f"--timeout={opts.timeout}"]
    if opts.reference:
        argv.append(f"--reference={opts.reference}")
    if opts.inject:
        argv.append("--inject")
    env = {**os.environ, "PYTHONPATH": checkout_pythonpath(), ENV_MARKER: str(directory)}
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in this terminal never reaches it
            cwd=directory,
        )
    _SPAWNED[directory] = proc
    (directory / PID_FILE).write_text(f"{proc.pid}\n")
    try:
        with _following(log, offset, say) as pump:
            while not (directory / CLUSTER_JSON).is_file():
                pump()
                if proc.poll() is not None:
                    raise DevError(
                        f"the dev cluster did not start (exit {proc.returncode}); "
                        f"log: {log}\n" + "\n".join(log.read_text().splitlines()[-25:])
                    )
                time.sleep(0.5)
            pump()
    except BaseException:
        down(directory, say=lambda _: None)
        raise
    return ClusterInfo.load(directory)


def down(directory: Path, say: Say = print, timeout: float = 180) -> int:
    """Stop the dev cluster in ``directory``: SIGTERM its supervisor (which stops what it
    started), then SIGKILL whatever still carries the directory's marker. Returns how many
    processes had to be killed that way (0 when the supervisor cleaned up everything)."""
    directory = Path(directory).resolve()
    pid = _read_pid(directory)
    if pid is not None and _ours(pid, directory):
        say(f"Stopping the dev cluster in {directory} (supervisor {pid})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _alive(pid):
            say(f"supervisor {pid} did not stop in {timeout:.0f}s: killing it")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    spawned = _SPAWNED.pop(directory, None)
    if spawned is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            spawned.wait(30)
    killed = 0
    for _ in range(3):  # stragglers (e.g. after a SIGKILL of the supervisor)
        rest = leftovers(directory)
        if not rest:
            break
        for leftover in rest:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leftover, signal.SIGKILL)
                killed += 1
        time.sleep(1)
    if killed:
        say(f"killed {killed} leftover processes of {directory}")
    for name in (CLUSTER_JSON, PID_FILE):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    return killed


if __name__ == "__main__":
    raise SystemExit(supervise())
