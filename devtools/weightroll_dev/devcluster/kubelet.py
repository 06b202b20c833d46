"""A kubelet for one namespace of a cluster without nodes: runs each pod as local processes.

:class:`PodSimulator` lists and watches the pods of a namespace (optionally a label selector)
and, for each pod, does what kubelet would:

1. allocates the pod's IP (a free loopback address ``127.0.0.N``);
2. materialises its volumes under ``<root>/<pod>/volumes/<volume>`` — ``secret`` (read from the
   API), ``emptyDir``, ``persistentVolumeClaim`` (see *Volumes* below);
3. starts every container as a process (:mod:`.podspec` turns the spec into a command line);
4. probes readiness (``httpGet`` readiness probes with their ``timeoutSeconds``,
   ``failureThreshold`` (over ``periodSeconds``) and ``successThreshold``; a container without
   one is ready while it runs), restarts containers that exit (``restartPolicy: Always``,
   bounded back-off), and
5. writes ``pods/status`` with a **strategic merge patch**: phase, ``podIP``, container statuses,
   ``Initialized``/``ContainersReady``/``Ready``/``PodScheduled``. ``Ready`` = every container
   ready **and** every readiness-gate condition True; it is recomputed as soon as a watch event
   shows a gate change. Gate conditions (``weightroll.io/weights-ready``) are never written:
   conditions merge by ``type``, so the operator's condition survives every write.

Deleting a pod (the API server removes unscheduled pods at once) stops its processes;
:meth:`PodSimulator.restart_pod` stops and restarts every container of a pod (vLLM boots its
boot weights again); creating more pods is scaling.

Volumes: a ``persistentVolumeClaim`` names a *persistent volume* directory given to the
simulator (``volumes={"claim": Path}``). Each pod gets its own **node-local copy** of it
(hard links, so it is cheap), like a node-local checkpoint cache: a file changed in one pod's
view by *replacing* it (unlink, write) affects only that pod — how the e2e tests corrupt one
pod's checkpoint. :meth:`PodSimulator.sync_volumes` links files added to a persistent volume
later into every pod's copy (the cache pulling a newly published checkpoint). Never modify a
linked file in place: that changes every copy.

How a pod names its boot model and where checkpoints live is the pod spec itself, as the chart's
example workload prepares it (``charts/weightroll/templates/workload-example.yaml``): the vLLM
container's model argument and the agent's ``--initial-source`` are paths under the models
mount; a WeightUpdate's ``file://`` source is a path in that same pod view.

Limitations:
    * No images, no namespaces or cgroups: resources, security contexts, probes other than
      ``httpGet`` readiness, init containers, ``configMap``/``hostPath`` volumes are ignored or
      refused (a refused pod stays ``Pending`` with the reason in its container status).
    * Probe period is the simulator's (``probe_period``), not the spec's, to keep tests fast.
    * Pods are never scheduled (no ``nodeName``): deletion is immediate, without grace.

Use :class:`SimulatorThread` to run it beside synchronous code (pytest, a CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import ssl
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from weightroll_operator.k8s.client import KubeConfig

from weightroll_dev.devcluster.podspec import (
    ContainerState,
    PodSpecError,
    build_argv,
    build_env,
    pod_status,
    readiness_gates,
    status_differs,
)
from weightroll_dev.devcluster.processes import ContainerProcess

__all__ = ["PodSimulator", "SimulatorConfig", "SimulatorThread"]

log = logging.getLogger(__name__)

SMP = "application/strategic-merge-patch+json"
T = TypeVar("T")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True, slots=True)
class SimulatorConfig:
    """What the simulator plays kubelet for, and how."""

    #: Namespace whose pods are run.
    namespace: str
    #: Directory for pod volumes, container roots and logs (``<root>/<pod>/...``).
    root: Path
    #: Only pods matching this label selector (``a=b,c=d``); ``None``: every pod.
    label_selector: str | None = None
    #: Persistent volumes: claim name -> directory.
    volumes: Mapping[str, Path] = field(default_factory=dict)
    #: Environment of every container before its own ``env`` (default: this process's).
    env: Mapping[str, str] | None = None
    #: First ``N`` tried for pod IPs ``127.0.0.N``.
    first_ip: int = 10
    #: Seconds between readiness probes (and status checks) of a pod.
    probe_period: float = 0.5
    #: Seconds before a container that exited is restarted (doubles up to 30 s).
    restart_delay: float = 2.0
    #: Python running vLLM (``vllm serve`` becomes ``python -m ...api_server``).
    python: str = sys.executable
    #: Where commands are looked up first (the virtualenv's ``bin``).
    bin_dir: Path = Path(sys.executable).parent


@dataclass(slots=True)
class _Container:
    spec: dict[str, Any]
    process: ContainerProcess | None = None
    ready: bool = False
    restarts: int = 0
    next_start: float = 0.0
    backoff: float = 0.0
    error: str | None = None
    #: Consecutive probe results against ``failureThreshold``/``successThreshold``.
    failures: int = 0
    successes: int = 0
    #: Monotonic time of the first failure of the current run of failures (0: none).
    failing_since: float = 0.0


@dataclass(slots=True)
class _Pod:
    name: str
    uid: str
    ip: str
    dir: Path
    spec: dict[str, Any]
    gates: tuple[str, ...]
    start_time: str
    observed: dict[str, dict[str, Any]] = field(default_factory=dict)
    observed_status: dict[str, Any] = field(default_factory=dict)
    containers: dict[str, _Container] = field(default_factory=dict)
    last_written: dict[str, Any] | None = None
    last_write_at: float = 0.0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    stopping: bool = False
    #: Set while :meth:`PodSimulator.restart_pod` runs: the pod loop leaves containers alone.
    restarting: bool = False


class PodSimulator:
    """Plays kubelet for the pods of one namespace (see the module docstring).

    Args:
        kube: API server and credentials (must be allowed to watch pods, read Secrets and
            patch ``pods/status`` in the namespace; the test admin is).
        config: what to simulate.
    """

    def __init__(self, kube: KubeConfig, config: SimulatorConfig) -> None:
        self.kube = kube
        self.config = config
        self.pods: dict[str, _Pod] = {}
        self._session: aiohttp.ClientSession | None = None
        self._watch: asyncio.Task[None] | None = None
        self._listed = asyncio.Event()

    # ---------------------------------------------------------------- lifecycle

    async def start(self, timeout: float = 30) -> None:
        """Connect, list the pods (starting them) and keep watching; returns after the list."""
        if self.kube.server.startswith("https") and self.kube.verify:
            ctx: ssl.SSLContext | bool = ssl.create_default_context(cafile=self.kube.ca_file)
            if self.kube.cert_file and self.kube.key_file:
                assert isinstance(ctx, ssl.SSLContext)
                ctx.load_cert_chain(self.kube.cert_file, self.kube.key_file)
        else:
            ctx = False
        headers = {"Accept": "application/json"}
        if self.kube.token:
            headers["Authorization"] = f"Bearer {self.kube.token}"
        self._session = aiohttp.ClientSession(
            base_url=self.kube.server,
            headers=headers,
            connector=aiohttp.TCPConnector(ssl=ctx),
        )
        self._watch = asyncio.ensure_future(self._watch_loop())
        await asyncio.wait_for(self._listed.wait(), timeout)

    async def stop(self) -> None:
        """Stop watching and stop every pod's processes."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._watch
        await asyncio.gather(*(self._remove(name) for name in list(self.pods)))
        if self._session is not None:
            await self._session.close()

    async def restart_pod(self, name: str) -> None:
        """Stop every container of ``name`` and start them again (restart counts go up)."""
        pod = self.pods[name]
        pod.restarting = True
        try:
            await asyncio.gather(
                *(c.process.stop() for c in pod.containers.values() if c.process is not None)
            )
            for c in pod.containers.values():
                c.ready = False
                c.restarts += 1
                c.backoff = 0.0
                c.next_start = 0.0
                await self._start_container(pod, c)
        finally:
            pod.restarting = False
        pod.wake.set()

    def pod_ip(self, name: str) -> str:
        return self.pods[name].ip

    async def refresh_secret_volumes(self, name: str) -> None:
        """Rewrite the ``secret`` volumes of ``name`` from the Secrets as they are now, each file
        replaced atomically: what kubelet's sync loop does some time after a Secret changes (the
        caller decides when, to play that propagation delay)."""
        await self._write_secret_volumes(self.pods[name])

    def pod_dir(self, name: str) -> Path:
        return self.pods[name].dir

    def volume_path(self, name: str, volume: str) -> Path:
        """Host directory of one volume of a pod (its node-local copy for a claim)."""
        return self.pods[name].dir / "volumes" / volume

    def container_log(self, name: str, container: str) -> Path:
        return self.pods[name].dir / "logs" / f"{container}.log"

    def sync_volumes(self) -> None:
        """Link files added to the persistent volumes into every running pod's copy."""
        for pod in self.pods.values():
            self._link_claims(pod)

    # ---------------------------------------------------------------- API

    def _sess(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() first"
        return self._session

    def _pods_url(self) -> str:
        return f"/api/v1/namespaces/{self.config.namespace}/pods"

    async def _list(self) -> str:
        params = {"labelSelector": self.config.label_selector or ""}
        async with self._sess().get(self._pods_url(), params=params) as resp:
            resp.raise_for_status()
            body = await resp.json()
        seen = set()
        for item in body.get("items") or []:
            seen.add(item["metadata"]["name"])
            await self._on_pod("ADDED", item)
        for name in set(self.pods) - seen:
            await self._remove(name)
        return str(body["metadata"]["resourceVersion"])

    async def _watch_loop(self) -> None:
        rv: str | None = None
        failures = 0
        while True:
            try:
                if rv is None:
                    rv = await self._list()
                    self._listed.set()
                params = {
                    "watch": "1",
                    "resourceVersion": rv,
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": "60",
                    "labelSelector": self.config.label_selector or "",
                }
                timeout = aiohttp.ClientTimeout(total=None, sock_read=90)
                async with self._sess().get(
                    self._pods_url(), params=params, timeout=timeout
                ) as resp:
                    if resp.status == 410:
                        rv = None
                        continue
                    resp.raise_for_status()
                    failures = 0
                    async for raw in resp.content:
                        if not raw.strip():
                            continue
                        event = json.loads(raw)
                        kind, obj = event.get("type"), event.get("object") or {}
                        if kind == "ERROR":
                            rv = None if obj.get("code") == 410 else rv
                            break
                        rv = obj.get("metadata", {}).get("resourceVersion", rv)
                        if kind != "BOOKMARK":
                            await self._on_pod(str(kind), obj)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # keep playing kubelet through API hiccups (bounded back-off)
                failures += 1
                log.warning("Pod watch failed (%s); retrying", e)
                await asyncio.sleep(min(0.2 * 2**failures, 5.0))
                if failures > 3:
                    rv = None

    async def _patch_status(self, pod: _Pod, status: dict[str, Any]) -> None:
        url = f"{self._pods_url()}/{pod.name}/status"
        body = json.dumps({"status": status})
        async with self._sess().patch(url, data=body, headers={"Content-Type": SMP}) as resp:
            if resp.status == 404:
                return
            if resp.status >= 400:
                log.warning("Status patch of Pod %s failed: %s", pod.name, await resp.text())
                return
        pod.last_written = status
        pod.last_write_at = time.monotonic()

    async def _secret(self, name: str) -> dict[str, bytes]:
        import base64

        url = f"/api/v1/namespaces/{self.config.namespace}/secrets/{name}"
        async with self._sess().get(url) as resp:
            if resp.status == 404:
                raise PodSpecError(f"secret {name!r} not found")
            resp.raise_for_status()
            body = await resp.json()
        return {k: base64.b64decode(v) for k, v in (body.get("data") or {}).items()}

    # ---------------------------------------------------------------- pods

    async def _on_pod(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name, uid = str(meta.get("name")), str(meta.get("uid"))
        known = self.pods.get(name)
        if kind == "DELETED" or meta.get("deletionTimestamp"):
            if known is not None:
                await self._remove(name)
            return
        if known is not None and known.uid != uid:
            await self._remove(name)
            known = None
        conditions = {
            str(c.get("type")): c for c in (obj.get("status") or {}).get("conditions") or []
        }
        if known is None:
            pod = self._admit(name, uid, obj)
            pod.observed = conditions
            pod.observed_status = obj.get("status") or {}
            self.pods[name] = pod
            pod.task = asyncio.ensure_future(self._run_pod(pod))
            log.info("Started Pod %s at %s", name, pod.ip)
            return
        known.observed = conditions
        known.observed_status = obj.get("status") or {}
        known.wake.set()

    def _admit(self, name: str, uid: str, obj: dict[str, Any]) -> _Pod:
        spec = obj.get("spec") or {}
        pod_dir = self.config.root.resolve() / name
        pod_dir.mkdir(parents=True, exist_ok=True)
        ports = [
            int(p["containerPort"])
            for c in spec.get("containers") or []
            for p in c.get("ports") or []
            if p.get("containerPort")
        ]
        return _Pod(
            name=name,
            uid=uid,
            ip=self._allocate_ip(ports),
            dir=pod_dir,
            spec=spec,
            gates=readiness_gates(spec),
            start_time=_now(),
            containers={str(c["name"]): _Container(spec=c) for c in spec.get("containers") or []},
        )

    def _allocate_ip(self, ports: list[int]) -> str:
        taken = {p.ip for p in self.pods.values()}
        for n in range(self.config.first_ip, 255):
            ip = f"127.0.0.{n}"
            if ip in taken:
                continue
            if all(_bindable(ip, port) for port in ports):
                return ip
        raise RuntimeError("no free loopback address for another pod")

    async def _remove(self, name: str) -> None:
        pod = self.pods.pop(name, None)
        if pod is None:
            return
        pod.stopping = True
        if pod.task is not None:
            pod.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pod.task
        await asyncio.gather(
            *(c.process.stop() for c in pod.containers.values() if c.process is not None)
        )
        log.info("Stopped Pod %s", name)

    async def _run_pod(self, pod: _Pod) -> None:
        try:
            await self._prepare_volumes(pod)
            for c in pod.containers.values():
                await self._start_container(pod, c)
        except PodSpecError as e:
            for c in pod.containers.values():
                c.error = str(e)
            log.warning("Pod %s cannot run: %s", pod.name, e)
        async with aiohttp.ClientSession() as http:
            while not pod.stopping:
                await self._tend(pod, http)
                await self._write_status(pod)
                pod.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pod.wake.wait(), self.config.probe_period)

    async def _tend(self, pod: _Pod, http: aiohttp.ClientSession) -> None:
        """Restart exited containers (after their back-off) and probe readiness."""
        if pod.restarting:
            return
        for c in pod.containers.values():
            proc = c.process
            if proc is None or c.error:
                c.ready = False
                continue
            if proc.poll() is not None:
                c.ready = False
                if c.next_start == 0.0:
                    c.backoff = min(max(c.backoff * 2, self.config.restart_delay), 30.0)
                    c.next_start = time.monotonic() + c.backoff
                    log.warning(
                        "Container %s of Pod %s exited with %s",
                        c.spec["name"],
                        pod.name,
                        proc.exit_code,
                    )
                elif time.monotonic() >= c.next_start:
                    c.restarts += 1
                    c.next_start = 0.0
                    await self._start_container(pod, c)
                continue
            ok = await self._probe(pod, c, http)
            # Like kubelet: a ready container turns unready only after failureThreshold
            # (default 3) consecutive failures, which kubelet spaces periodSeconds (default 10)
            # apart: the simulator probes more often, so it also waits that long since the first
            # failure. One slow answer on a loaded machine does not take a pod out of traffic.
            spec = c.spec.get("readinessProbe") or {}
            now = time.monotonic()
            if ok:
                c.failures, c.successes, c.failing_since = 0, c.successes + 1, 0.0
                if c.successes >= int(spec.get("successThreshold") or 1):
                    c.ready = True
                continue
            c.failures, c.successes = c.failures + 1, 0
            c.failing_since = c.failing_since or now
            threshold = int(spec.get("failureThreshold") or 3)
            window = (threshold - 1) * float(spec.get("periodSeconds") or 10)
            if not c.ready or (c.failures >= threshold and now - c.failing_since >= window):
                c.ready = False

    async def _probe(self, pod: _Pod, c: _Container, http: aiohttp.ClientSession) -> bool:
        spec = c.spec.get("readinessProbe") or {}
        probe = spec.get("httpGet")
        if probe is None:
            return True
        port: Any = probe.get("port")
        if isinstance(port, str) and not port.isdigit():
            named = {p.get("name"): p.get("containerPort") for p in c.spec.get("ports") or []}
            port = named.get(port)
        if port is None:
            return False
        # Like kubelet: `scheme: HTTPS` probes without verifying the certificate.
        scheme = str(probe.get("scheme", "HTTP")).lower()
        url = f"{scheme}://{pod.ip}:{port}{probe.get('path', '/')}"
        try:
            timeout = aiohttp.ClientTimeout(total=float(spec.get("timeoutSeconds") or 1))
            async with http.get(url, timeout=timeout, ssl=False) as resp:
                return 200 <= resp.status < 400
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _container_states(self, pod: _Pod) -> list[ContainerState]:
        out = []
        for name, c in pod.containers.items():
            image = str(c.spec.get("image", ""))
            proc = c.process
            started = (
                datetime.fromtimestamp(proc.started_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                if proc is not None
                else None
            )
            if c.error or proc is None or proc.process is None:
                state = ContainerState(name, image, "waiting", False, c.restarts, reason="Error")
            elif proc.exit_code is not None:
                state = ContainerState(
                    name, image, "terminated", False, c.restarts, started, proc.exit_code
                )
            else:
                state = ContainerState(name, image, "running", c.ready, c.restarts, started)
            out.append(state)
        return out

    async def _write_status(self, pod: _Pod) -> None:
        desired = pod_status(
            pod_ip=pod.ip,
            start_time=pod.start_time,
            containers=self._container_states(pod),
            gates=pod.gates,
            observed=pod.observed,
            now=_now(),
        )
        if pod.last_written is not None and not status_differs(desired, pod.last_written):
            # Written already; rewrite only if the API shows something else for a while.
            if not status_differs(desired, pod.observed_status):
                return
            if time.monotonic() - pod.last_write_at < 2.0:
                return
        await self._patch_status(pod, desired)

    # ---------------------------------------------------------------- containers and volumes

    async def _prepare_volumes(self, pod: _Pod) -> None:
        base = pod.dir / "volumes"
        base.mkdir(parents=True, exist_ok=True)
        for vol in pod.spec.get("volumes") or []:
            target = base / str(vol["name"])
            if "emptyDir" in vol or "secret" in vol:
                target.mkdir(exist_ok=True)
            elif "persistentVolumeClaim" in vol:
                claim = str(vol["persistentVolumeClaim"]["claimName"])
                if claim not in self.config.volumes:
                    raise PodSpecError(f"no persistent volume for claim {claim!r}")
                target.mkdir(exist_ok=True)
            else:
                raise PodSpecError(
                    f"volume {vol['name']!r}: only secret, emptyDir and "
                    "persistentVolumeClaim are simulated"
                )
        await self._write_secret_volumes(pod)
        self._link_claims(pod)

    async def _write_secret_volumes(self, pod: _Pod) -> None:
        for vol in pod.spec.get("volumes") or []:
            if "secret" not in vol:
                continue
            target = pod.dir / "volumes" / str(vol["name"])
            data = await self._secret(str(vol["secret"]["secretName"]))
            items = vol["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    raise PodSpecError(f"secret key {item['key']!r} not found")
                out = target / item["path"]
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_name(f".{out.name}.tmp")
                tmp.write_bytes(data[item["key"]])
                tmp.chmod(0o600)
                tmp.replace(out)

    def _link_claims(self, pod: _Pod) -> None:
        for vol in pod.spec.get("volumes") or []:
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            source = self.config.volumes.get(str(claim)) if claim else None
            if source is None:
                continue
            _link_tree(source, pod.dir / "volumes" / str(vol["name"]))

    def _rootfs(self, pod: _Pod, c: _Container) -> tuple[Path, list[str]]:
        root = pod.dir / "rootfs" / str(c.spec["name"])
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            mount = str(m["mountPath"])
            link = root / mount.lstrip("/")
            target = pod.dir / "volumes" / str(m["name"]) / str(m.get("subPath", ""))
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(target)
            mounts.append(mount)
        root.mkdir(parents=True, exist_ok=True)
        return root, mounts

    async def _start_container(self, pod: _Pod, c: _Container) -> None:
        root, mounts = self._rootfs(pod, c)
        argv = build_argv(
            c.spec,
            mounts=mounts,
            root=root,
            pod_ip=pod.ip,
            python=self.config.python,
            bin_dir=self.config.bin_dir,
        )
        base = dict(os.environ if self.config.env is None else self.config.env)
        env = build_env(c.spec, base=base, mounts=mounts, root=root, pod_ip=pod.ip)
        proc = ContainerProcess(
            name=str(c.spec["name"]),
            argv=argv,
            env=env,
            log=pod.dir / "logs" / f"{c.spec['name']}.log",
        )
        c.process = proc  # before starting: a pod removed meanwhile stops it too
        await proc.start()


def _bindable(ip: str, port: int) -> bool:
    with socket.socket() as s:
        # Like the servers themselves: a port in TIME_WAIT from an earlier pod is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


def _link_tree(source: Path, dest: Path) -> None:
    """Hard-link every file of ``source`` missing in ``dest`` (copy across file systems).

    Dot-named entries are skipped: a writer builds there and renames into place when done
    (``weightroll_dev.demomodels``), so a half-written checkpoint is never linked.
    """
    for dirpath, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files = [f for f in files if not f.startswith(".")]
        rel = Path(dirpath).relative_to(source)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            target = dest / rel / f
            if target.exists() or target.is_symlink():
                continue
            try:
                os.link(Path(dirpath) / f, target)
            except OSError:
                import shutil

                shutil.copy2(Path(dirpath) / f, target)


class SimulatorThread:
    """Runs a :class:`PodSimulator` on its own event loop in a daemon thread.

    >>> # sim = SimulatorThread(PodSimulator(kube, config)); sim.start(); ...; sim.stop()
    """

    def __init__(self, simulator: PodSimulator) -> None:
        self.simulator = simulator
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pod-simulator", daemon=True
        )

    def start(self, timeout: float = 60) -> None:
        self._thread.start()
        self.call(self.simulator.start, timeout=timeout)

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 120) -> T:
        """Run ``fn(*args)`` on the simulator's loop and return its result."""

        async def _run() -> T:
            return await fn(*args)

        return asyncio.run_coroutine_threadsafe(_run(), self._loop).result(timeout)

    def run(self, fn: Callable[[], T], timeout: float = 30) -> T:
        """Run a plain function on the simulator's loop (to read its state consistently)."""

        async def _run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(_run(), self._loop).result(timeout)

    def stop(self, timeout: float = 120) -> None:
        """Stop every pod and the loop; safe to call twice."""
        if not self._thread.is_alive():
            return
        try:
            self.call(self.simulator.stop, timeout=timeout)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
