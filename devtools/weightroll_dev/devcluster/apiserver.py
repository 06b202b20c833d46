"""The local kube-apiserver (+ etcd) of ``scripts/kube-apiserver.sh``: build check, start, stop.

Used by the cluster test tier (``tests/harness/apiserver.py``) and the cluster demo
(``weightroll_dev demo``). It starts etcd and kube-apiserver 1.20.2 on free loopback ports
in a run directory, with RBAC authorization and two static tokens: an admin (``system:masters``) and
the operator's ServiceAccount identity (the chart's ServiceAccount ``weightroll-operator`` in
``weightroll-system`` for the release name ``weightroll``). The script lives in the source
tree: this module works from a checkout (an editable install), not from a wheel.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BUILD_HINT",
    "OPERATOR_NAMESPACE",
    "OPERATOR_SERVICEACCOUNT",
    "SCRIPT",
    "KubeCluster",
    "apiserver_binary",
    "free_ports",
    "run_kubectl",
    "start_apiserver",
    "stop_apiserver",
]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "kube-apiserver.sh"
#: Identity of the operator's static token; matches the chart's ServiceAccount for release
#: ``weightroll`` installed in namespace ``weightroll-system``.
OPERATOR_NAMESPACE = "weightroll-system"
OPERATOR_SERVICEACCOUNT = "weightroll-operator"
BUILD_HINT = (
    "run `bash scripts/kube-apiserver.sh build` (with the node binaries ≈9-17 min on 2 cores, "
    "cached; .ci/run does it) or set WEIGHTROLL_KUBECONFIG to an existing cluster's kubeconfig"
)


@dataclass(frozen=True, slots=True)
class KubeCluster:
    """A reachable Kubernetes API server and how to talk to it."""

    #: Admin kubeconfig (cluster-admin / system:masters).
    kubeconfig: Path
    #: API server URL, e.g. ``https://127.0.0.1:16443``.
    server: str
    #: True for a cluster given through WEIGHTROLL_KUBECONFIG (nothing was started).
    external: bool
    #: Admin bearer token (built-in apiserver only).
    admin_token: str | None = None
    #: Static token of the operator's ServiceAccount identity (built-in apiserver only).
    operator_token: str | None = None
    #: User name of that token, ``system:serviceaccount:<ns>:<name>``.
    operator_user: str | None = None
    #: Kubeconfig authenticating with ``operator_token`` (built-in apiserver only).
    operator_kubeconfig: Path | None = None
    #: Run directory with logs and PIDs (built-in apiserver only).
    run_dir: Path | None = None


def apiserver_binary() -> Path | None:
    """Return the built kube-apiserver binary, or None when it is not built."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), "path"], capture_output=True, text=True, check=False
    )
    path = proc.stdout.strip()
    return Path(path) if proc.returncode == 0 and path else None


def run_kubectl(
    kubeconfig: Path, *args: str, input_: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``kubectl --kubeconfig=KUBECONFIG ARGS``; the caller checks ``returncode``."""
    return subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args],
        input=input_,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1 (held together while picked)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _read_env_file(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key] = value
    return out


def start_apiserver(
    run_dir: Path,
    extra_args: Sequence[str] = (),
    command_prefix: Sequence[str] = (),
    node_name: str | None = None,
) -> KubeCluster:
    """Start etcd and kube-apiserver on free loopback ports with state in ``run_dir``.

    Args:
        run_dir: state, logs and kubeconfigs.
        extra_args: appended to the kube-apiserver command line (``APISERVER_EXTRA_ARGS``),
            e.g. the audit log flags of ``tests/harness/apiserver.py``; no spaces inside one.
        command_prefix: runs the script under it, e.g. ``nsenter --net=…`` so etcd and the
            apiserver bind the loopback of a network namespace (the real node).
        node_name: also issue a kubelet token for this node (``kubeconfig-node`` in ``run_dir``).

    Raises:
        ValueError: an argument in ``extra_args`` is empty or contains whitespace.
        RuntimeError: when the apiserver does not become ready (the message carries its log tail).
    """
    etcd, peer, metrics, api = free_ports(4)
    env = dict(
        os.environ,
        WEIGHTROLL_KUBE_RUN=str(run_dir),
        ETCD_PORT=str(etcd),
        ETCD_PEER_PORT=str(peer),
        ETCD_METRICS_PORT=str(metrics),
        APISERVER_PORT=str(api),
        OPERATOR_NAMESPACE=OPERATOR_NAMESPACE,
        OPERATOR_SERVICEACCOUNT=OPERATOR_SERVICEACCOUNT,
    )
    if any(not arg or any(ch.isspace() for ch in arg) for arg in extra_args):
        # The script word-splits APISERVER_EXTRA_ARGS; a quoted argument would stay quoted.
        raise ValueError(f"an apiserver argument is empty or holds whitespace: {extra_args!r}")
    if extra_args:
        env["APISERVER_EXTRA_ARGS"] = " ".join(extra_args)
    if node_name:
        env["NODE_NAME"] = node_name
    proc = subprocess.run(
        [*command_prefix, "bash", str(SCRIPT), "start"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"kube-apiserver did not start:\n{proc.stderr[-4000:]}")
    tokens = _read_env_file(run_dir / "tokens.env")
    return KubeCluster(
        kubeconfig=run_dir / "kubeconfig",
        server=f"https://127.0.0.1:{api}",
        external=False,
        admin_token=tokens["ADMIN_TOKEN"],
        operator_token=tokens["OPERATOR_TOKEN"],
        operator_user=tokens["OPERATOR_USER"],
        operator_kubeconfig=run_dir / "kubeconfig-operator",
        run_dir=run_dir,
    )


def stop_apiserver(run_dir: Path) -> None:
    """Stop the etcd and kube-apiserver started with ``run_dir`` (by their recorded PIDs)."""
    env = dict(os.environ, WEIGHTROLL_KUBE_RUN=str(run_dir))
    subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, check=False)
