"""Bring a one-node Kubernetes 1.20 up inside a network namespace, and take it down completely.

``up`` creates a network namespace with a dummy interface for the node address (and the default
route on it) and then starts, each inside that namespace: etcd and the self-built kube-apiserver
(``scripts/kube-apiserver.sh start``), containerd with a bridge CNI network, the kubelet,
kube-controller-manager and kube-scheduler; it imports a locally built pause and tiny image and
returns once the node is Ready and the ``default`` ServiceAccount exists. Every address anything
talks to is the namespace's loopback, the node address or a pod address on the bridge: the
namespace has no link to the host, so nothing can be sent elsewhere.

``down`` undoes all of it from the record ``up`` writes first (``node.json``): pods deleted
through the API so the kubelet tears down their sandboxes, every remaining task killed through
containerd, every process stopped by recorded PID, mounts under the node's paths unmounted, the
``kubepods`` cgroups removed, the namespace deleted, the kernel settings the kubelet changed
restored, and host directories that did not exist before removed.

Limitations: needs root, the four binaries of ``scripts/kube-apiserver.sh build`` and
``scripts/system-deps.sh``'s containerd, runc and CNI plugins; one real node per host at a time
(the kubelet owns the ``kubepods`` cgroups and ``/var/log/pods``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from weightroll_dev.devcluster.apiserver import (
    SCRIPT,
    apiserver_binary,
    start_apiserver,
    stop_apiserver,
)
from weightroll_dev.realnode import host, images
from weightroll_dev.realnode.config import (
    NODE_ADDRESS,
    NODE_INTERFACE,
    NODE_PEER,
    NODE_PREFIX,
    NodeLayout,
    cni_config,
    containerd_config,
    kubelet_config,
)

__all__ = ["NODE_BINARIES", "NodeError", "RealNode", "down", "missing_prerequisites", "up"]

NODE_BINARIES = ("kubelet", "kube-controller-manager", "kube-scheduler")
SYSTEM_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "nsenter", "gcc")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
#: Processes in the order ``down`` stops them: the kubelet first, so it restarts nothing.
PROCESS_ORDER = ("kubelet", "kube-scheduler", "kube-controller-manager", "containerd")


#: The kubelet's in-tree AWS credential provider asks the EC2 metadata service
#: (169.254.169.254) for credentials at start: an address outside the namespace.
NODE_ENV = {**os.environ, "AWS_EC2_METADATA_DISABLED": "true"}


class NodeError(RuntimeError):
    """The real node could not be brought up (or taken down completely)."""


def _binary_dir() -> Path | None:
    apiserver = apiserver_binary()
    return apiserver.parent if apiserver else None


def missing_prerequisites() -> list[str]:
    """What the real node needs and this host lacks (empty when it can run)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespace, cgroups, mounts)")
    bin_dir = _binary_dir()
    if bin_dir is None or any(not (bin_dir / b).is_file() for b in NODE_BINARIES):
        missing.append(f"kubelet, controller-manager, scheduler (bash {SCRIPT} build)")
    missing += [
        f"{tool} (scripts/system-deps.sh)" for tool in SYSTEM_TOOLS if shutil.which(tool) is None
    ]
    missing += [
        f"CNI plugin {p} (scripts/system-deps.sh)"
        for p in CNI_PLUGINS
        if not Path("/usr/lib/cni", p).is_file()
    ]
    return missing


@dataclass(frozen=True, slots=True)
class RealNode:
    """A running real node and how to reach it (from inside its network namespace)."""

    layout: NodeLayout
    netns: str
    node_name: str
    kubeconfig: Path
    #: Seconds from ``up`` to node Ready and the ``default`` ServiceAccount.
    startup_seconds: float

    def in_netns(self, *argv: str) -> list[str]:
        """``argv`` run inside the node's network namespace (and the host's mounts)."""
        return in_netns(self.netns, argv)

    def kubectl(
        self, *args: str, input_: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl as admin against the node's apiserver; the caller checks returncode."""
        return subprocess.run(
            self.in_netns("kubectl", f"--kubeconfig={self.kubeconfig}", *args),
            input=input_,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )

    def packets_towards_outside(self) -> int:
        """Packets that reached the node interface's peer: every packet for an address outside
        the namespace (the default route's only way) and nothing else (IPv6 is off)."""
        out = subprocess.run(
            ["ip", "-n", self.netns, "-s", "-j", "link", "show", "dev", NODE_PEER],
            capture_output=True,
            text=True,
            check=True,
        )
        (link,) = json.loads(out.stdout)
        return int(link["stats64"]["rx"]["packets"])

    def ctr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``ctr`` against the node's containerd, namespace ``k8s.io``."""
        return subprocess.run(
            ["ctr", "--address", str(self.layout.containerd_socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )


def in_netns(netns: str, argv: Sequence[str]) -> list[str]:
    # nsenter enters only the network namespace: the kubelet's volume mounts must stay visible
    # to containerd, which `ip netns exec` (a private mount namespace per command) would hide.
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


def netns_name(layout: NodeLayout) -> str:
    digest = hashlib.sha256(str(layout.root.resolve()).encode()).hexdigest()[:8]
    return f"weightroll-{digest}"


def _run(argv: Sequence[str], what: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NodeError(f"{what} failed: {' '.join(argv)}: {proc.stderr.strip()}")


def _save_record(layout: NodeLayout, record: dict[str, object]) -> None:
    tmp = layout.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(layout.state_file)


def _start_process(
    layout: NodeLayout, record: dict[str, object], netns: str, name: str, argv: list[str]
) -> None:
    layout.logs.mkdir(parents=True, exist_ok=True)
    with (layout.logs / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            in_netns(netns, argv),
            env=NODE_ENV,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    pids = record.setdefault("pids", {})
    assert isinstance(pids, dict)
    # nsenter execs the command in place: this PID is the binary's.
    pids[name] = proc.pid
    _save_record(layout, record)


def _wait(
    what: str, ready: Callable[[], bool], deadline: float, alive: Callable[[], str | None]
) -> None:
    while time.monotonic() < deadline:
        if ready():
            return
        dead = alive()
        if dead:
            raise NodeError(f"{dead} exited while waiting for {what}")
        time.sleep(0.5)
    raise NodeError(f"timed out waiting for {what}")


def _import_images(layout: NodeLayout, bin_dir: Path) -> None:
    tarballs = sorted((bin_dir.parent / "build" / "src").glob("kubernetes_*.orig.tar.gz"))
    if not tarballs:
        raise NodeError(f"no Kubernetes source tarball under {bin_dir.parent}/build/src for pause")
    pause = images.build_pause_binary(tarballs[0], layout.images / "pause")
    archives = [
        images.write_oci_archive(
            layout.images / "pause.tar",
            images.PAUSE_IMAGE,
            images.pause_layer(pause),
            ["/pause"],
        ),
        images.write_oci_archive(
            layout.images / "tiny.tar", images.TINY_IMAGE, images.tiny_layer(), ["/bin/sh"]
        ),
    ]
    for archive in archives:
        _run(
            [
                "ctr",
                "--address",
                str(layout.containerd_socket),
                "-n",
                "k8s.io",
                "images",
                "import",
                str(archive),
            ],
            f"importing {archive.name}",
        )


def up(root: Path, say: Callable[[str], None] = lambda _: None, timeout: float = 180) -> RealNode:
    """Bring the real node up with all state under ``root``; return once it is Ready.

    Order contract: on any failure everything started so far is taken down again (``down``)
    before the error propagates.

    Raises:
        NodeError: a prerequisite is missing, a node already runs in ``root`` or on the host, or
            a component failed to start (the message names it; logs are in ``root/logs``).
    """
    missing = missing_prerequisites()
    if missing:
        raise NodeError("the real node needs: " + "; ".join(missing))
    layout = NodeLayout(root.resolve())
    if layout.state_file.exists():
        raise NodeError(f"a real node is recorded in {layout.state_file}; run `down` first")
    if host.cgroup_dirs():
        raise NodeError("kubepods cgroups exist: another kubelet runs on this host")
    bin_dir = _binary_dir()
    assert bin_dir is not None  # checked by missing_prerequisites
    t0 = time.monotonic()
    layout.root.mkdir(parents=True, exist_ok=True)
    netns = netns_name(layout)
    node_name = "weightroll-node"
    record: dict[str, object] = {
        "netns": netns,
        "node_name": node_name,
        "sysctls": host.read_sysctls(),
        "host_paths": {p: os.path.lexists(p) for p in host.HOST_PATHS},
        "run_netns_existed": os.path.isdir("/run/netns"),
        "netns_before": sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else [],
        "pids": {},
    }
    _save_record(layout, record)
    try:
        return _bring_up(layout, record, bin_dir, say, t0 + timeout, t0)
    except BaseException:
        say("real node: bring-up failed; taking down what started")
        for problem in down(layout.root):
            say(f"real node: left behind: {problem}")
        raise


def _bring_up(
    layout: NodeLayout,
    record: dict[str, object],
    bin_dir: Path,
    say: Callable[[str], None],
    deadline: float,
    t0: float,
) -> RealNode:
    netns, node_name = str(record["netns"]), str(record["node_name"])
    say(f"real node: network namespace {netns}")
    _run(["ip", "netns", "add", netns], "creating the network namespace")
    ip_n = ["ip", "-n", netns]
    # No IPv6: its link-local autoconfiguration would send neighbour discovery on the node
    # interface, the counter that proves nothing was sent towards any other address.
    _run(
        in_netns(netns, ["sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"]),
        "disabling IPv6 in the namespace",
    )
    _run(
        in_netns(netns, ["sysctl", "-q", "-w", "net.ipv6.conf.default.disable_ipv6=1"]),
        "disabling IPv6 in the namespace",
    )
    _run([*ip_n, "link", "set", "lo", "up"], "loopback up")
    # A veth pair with both ends inside: the kernel here has no dummy interfaces, and a bridge
    # without ports has no carrier for the default route.
    _run(
        [*ip_n, "link", "add", NODE_INTERFACE, "type", "veth", "peer", "name", NODE_PEER],
        "node interface",
    )
    _run([*ip_n, "link", "set", NODE_PEER, "up"], "node interface peer up")
    _run(
        [*ip_n, "addr", "add", f"{NODE_ADDRESS}/{NODE_PREFIX}", "dev", NODE_INTERFACE],
        "node address",
    )
    _run([*ip_n, "link", "set", NODE_INTERFACE, "up"], "node interface up")
    _run([*ip_n, "route", "add", "default", "dev", NODE_INTERFACE], "default route")

    say("real node: etcd + kube-apiserver")
    try:
        cluster = start_apiserver(
            layout.apiserver_run,
            # By name it would ask the host's DNS server (outside the namespace) for the node.
            extra_args=["--kubelet-preferred-address-types=InternalIP"],
            command_prefix=in_netns(netns, []),
            node_name=node_name,
        )
    except RuntimeError as e:
        raise NodeError(str(e)) from e
    run = layout.apiserver_run

    say("real node: containerd")
    for d in (layout.containerd, layout.cni_conf_dir, layout.cni_ipam_dir, layout.images):
        d.mkdir(parents=True, exist_ok=True)
    layout.containerd_config.write_text(containerd_config(layout, images.PAUSE_IMAGE))
    (layout.cni_conf_dir / "10-weightroll.conflist").write_text(cni_config(layout))
    _start_process(
        layout,
        record,
        netns,
        "containerd",
        ["containerd", "--config", str(layout.containerd_config)],
    )
    pids = record["pids"]
    assert isinstance(pids, dict)

    def dead() -> str | None:
        return next((n for n, pid in pids.items() if not _alive(pid)), None)

    _wait("containerd's socket", layout.containerd_socket.exists, deadline, dead)
    _import_images(layout, bin_dir)

    say("real node: kubelet, controller-manager, scheduler")
    layout.kubelet.mkdir(parents=True, exist_ok=True)
    layout.kubelet_config.write_text(kubelet_config(layout))
    _start_process(
        layout,
        record,
        netns,
        "kubelet",
        [
            str(bin_dir / "kubelet"),
            f"--config={layout.kubelet_config}",
            f"--kubeconfig={run / 'kubeconfig-node'}",
            f"--root-dir={layout.kubelet_root}",
            f"--cert-dir={layout.kubelet / 'pki'}",
            f"--volume-plugin-dir={layout.kubelet / 'volume-plugins'}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{layout.containerd_socket}",
            f"--node-ip={NODE_ADDRESS}",
            f"--hostname-override={node_name}",
            "--v=1",
        ],
    )
    common = [
        f"--kubeconfig={cluster.kubeconfig}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--port=0",
    ]
    _start_process(
        layout,
        record,
        netns,
        "kube-controller-manager",
        [
            str(bin_dir / "kube-controller-manager"),
            *common,
            f"--service-account-private-key-file={run / 'sa.key'}",
            f"--root-ca-file={run / 'certs' / 'apiserver.crt'}",
            "--use-service-account-credentials=false",
        ],
    )
    _start_process(
        layout, record, netns, "kube-scheduler", [str(bin_dir / "kube-scheduler"), *common]
    )
    node = RealNode(layout, netns, node_name, cluster.kubeconfig, 0.0)

    def node_ready() -> bool:
        out = node.kubectl("get", "node", node_name, "-o", "json")
        if out.returncode != 0:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    say("real node: waiting for node Ready")
    _wait(f"node {node_name} Ready", node_ready, deadline, dead)
    _wait(
        "the default ServiceAccount",
        lambda: node.kubectl("get", "serviceaccount", "default").returncode == 0,
        deadline,
        dead,
    )
    startup = time.monotonic() - t0
    record["startup_seconds"] = round(startup, 1)
    _save_record(layout, record)
    say(f"real node: Ready after {startup:.1f} s")
    return RealNode(layout, netns, node_name, cluster.kubeconfig, startup)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False  # kill(0, …) would address our own process group
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our own unreaped child) counts as gone.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False


def _stop_pid(pid: int, expect: str, grace: float = 10) -> None:
    """SIGTERM ``pid`` if its command line still names ``expect``; SIGKILL after ``grace``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return
    if expect not in cmdline:
        return  # the PID was reused by an unrelated process
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def _pids_naming(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def _kill_pod_processes() -> None:
    """SIGKILL every process left in the kubepods cgroups (containers whose shim is gone)."""
    for group in host.cgroup_dirs():
        for procs in group.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                for line in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(line), signal.SIGKILL)


def _drain_pods(node: RealNode, pids: dict[str, int]) -> None:
    """Delete every pod through the API and wait (bounded) for containerd to run no task."""
    if not (_alive(pids.get("kubelet", 0)) and _alive(pids.get("containerd", 0))):
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        node.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=1",
                     "--wait=false", timeout=20)  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        tasks = node.ctr("tasks", "ls", timeout=10)
        if tasks.returncode != 0 or "RUNNING" not in tasks.stdout:
            return
        time.sleep(1)


def _remove_containers(node: RealNode) -> None:
    tasks = node.ctr("tasks", "ls", "-q", timeout=10)
    for task in tasks.stdout.split() if tasks.returncode == 0 else []:
        node.ctr("tasks", "kill", "-s", "SIGKILL", task, timeout=10)
        node.ctr("tasks", "delete", "-f", task, timeout=10)
    containers = node.ctr("containers", "ls", "-q", timeout=10)
    for container in containers.stdout.split() if containers.returncode == 0 else []:
        node.ctr("containers", "delete", container, timeout=10)


def down(root: Path) -> list[str]:
    """Take the real node recorded in ``root`` down; return what could not be undone.

    A no-op when ``root`` holds no record. Safe to repeat after a partial failure.
    """
    layout = NodeLayout(root.resolve())
    if not layout.state_file.exists():
        return []
    record = json.loads(layout.state_file.read_text())
    pids: dict[str, int] = record.get("pids", {})
    netns = record["netns"]
    node = RealNode(layout, netns, record["node_name"], layout.apiserver_run / "kubeconfig", 0.0)
    problems: list[str] = []
    has_netns = Path("/run/netns", netns).exists()
    if has_netns:
        _drain_pods(node, pids)
    for name in PROCESS_ORDER[:-1]:
        if name in pids:
            _stop_pid(pids[name], name)
    if _alive(pids.get("containerd", 0)):
        _remove_containers(node)
    if "containerd" in pids:
        _stop_pid(pids["containerd"], "containerd")
    # Shims outlive containerd by design; ours name our socket on their command line.
    for pid in _pids_naming(str(layout.containerd_socket)):
        _stop_pid(pid, str(layout.containerd_socket), grace=2)
    _kill_pod_processes()
    stop_apiserver(layout.apiserver_run)

    new_netns = [
        n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else [])
        if n not in record.get("netns_before", []) and (n == netns or n.startswith("cni-"))
    ]  # fmt: skip
    mount_roots = [layout.root, *(Path("/run/netns", n) for n in new_netns if n != netns)]
    host_paths: dict[str, bool] = record.get("host_paths", {})
    mount_roots += [Path(p) for p, existed in host_paths.items() if not existed]
    if netns in new_netns:
        proc = subprocess.run(["ip", "netns", "del", netns], capture_output=True, text=True)
        if proc.returncode != 0:
            problems.append(f"ip netns del {netns}: {proc.stderr.strip()}")
    problems += host.unmount_under([r for r in mount_roots if r.exists()])
    for name in new_netns:
        with contextlib.suppress(FileNotFoundError):
            Path("/run/netns", name).unlink()
    run_netns = Path("/run/netns")
    created_run_netns = not record.get("run_netns_existed", True) and run_netns.is_dir()
    if created_run_netns and not any(run_netns.iterdir()):
        # `ip netns add` made /run/netns a shared bind mount of itself; undo it once empty.
        problems += host.unmount_under([run_netns])
        with contextlib.suppress(OSError):
            run_netns.rmdir()
    for group in host.cgroup_dirs():
        problems += host.remove_cgroup_tree(group)
    problems += host.restore_sysctls(record.get("sysctls", {}))
    host.remove_new_paths(host_paths)
    if not problems:
        # Keep the record when something is left, so `down` can be run again; keep the logs.
        for entry in layout.root.iterdir():
            if entry != layout.logs:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)  # a concurrent `down` may have gone first
    return problems
