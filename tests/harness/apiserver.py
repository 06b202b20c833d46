"""A real kube-apiserver (+ etcd) for the cluster test tier, or an existing cluster.

The ``kube_cluster`` fixture (session scope) yields a :class:`KubeCluster`:

- With ``WEIGHTROLL_KUBECONFIG`` set, that kubeconfig is used as is (kind, a real cluster); the
  fixture starts and stops nothing. Tests that need a static operator token must then get one with
  :func:`service_account_token` (TokenRequest).
- Otherwise it starts etcd and kube-apiserver 1.20.2 through ``scripts/kube-apiserver.sh start`` in
  a fresh run directory on free loopback ports, with RBAC authorization and two static tokens: an
  admin (``system:masters``) and the operator's ServiceAccount identity
  ``system:serviceaccount:weightroll-system:weightroll-operator`` (the chart's ServiceAccount for
  the release name ``weightroll``), so bindings from the chart apply to it. Both are stopped
  afterwards.
- When the apiserver binary is not built, every test using the fixture is skipped with the command
  that builds it (``bash scripts/kube-apiserver.sh build``, ≈6 min on 2 cores, cached in
  ``${XDG_CACHE_HOME:-~/.cache}/weightroll/kube``; ``.ci/run`` does it).

Limitations of the built-in apiserver (``../shared/design/tooling.md`` §1): no controller-manager,
scheduler or kubelet (pods stay Pending unless a test plays kubelet; Deployments get no pods; the
``default`` ServiceAccount does not exist), Kubernetes 1.20 (no CEL).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "KubeCluster",
    "apiserver_binary",
    "kube_cluster",
    "kubectl",
    "service_account_token",
    "start_apiserver",
    "stop_apiserver",
]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "kube-apiserver.sh"
#: Identity of the operator's static token; matches the chart's ServiceAccount for release
#: ``weightroll`` installed in namespace ``weightroll-system``.
OPERATOR_NAMESPACE = "weightroll-system"
OPERATOR_SERVICEACCOUNT = "weightroll-operator"
BUILD_HINT = (
    "run `bash scripts/kube-apiserver.sh build` (≈6 min on 2 cores, cached; .ci/run does it) "
    "or set WEIGHTROLL_KUBECONFIG to an existing cluster's kubeconfig"
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


def _free_ports(count: int) -> list[int]:
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


def start_apiserver(run_dir: Path) -> KubeCluster:
    """Start etcd and kube-apiserver on free loopback ports with state in ``run_dir``.

    Raises:
        RuntimeError: when the apiserver does not become ready (the message carries its log tail).
    """
    etcd, peer, metrics, api = _free_ports(4)
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
    proc = subprocess.run(
        ["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, check=False
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


def kubectl(
    cluster: KubeCluster,
    *args: str,
    kubeconfig: Path | None = None,
    check: bool = True,
    input_: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run kubectl against ``cluster`` (admin unless ``kubeconfig`` is given).

    Raises:
        AssertionError: with kubectl's stderr when ``check`` and it exits non-zero.
    """
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed")
    cfg = kubeconfig or cluster.kubeconfig
    proc = subprocess.run(
        [exe, f"--kubeconfig={cfg}", *args],
        input=input_,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def service_account_token(cluster: KubeCluster, namespace: str, name: str) -> str:
    """Return a bound token for a ServiceAccount through the TokenRequest API."""
    proc = kubectl(cluster, "create", "token", name, "-n", namespace, "--duration=1h")
    return proc.stdout.strip()


def _external_cluster(kubeconfig: str) -> KubeCluster:
    path = Path(kubeconfig).expanduser()
    if not path.is_file():
        pytest.fail(f"WEIGHTROLL_KUBECONFIG={kubeconfig} is not a file")
    exe = shutil.which("kubectl")
    server = ""
    if exe:
        proc = subprocess.run(
            [
                exe,
                f"--kubeconfig={path}",
                "config",
                "view",
                "--minify",
                "-o",
                "jsonpath={.clusters[0].cluster.server}",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        server = proc.stdout.strip()
    return KubeCluster(kubeconfig=path, server=server, external=True)


@pytest.fixture(scope="session")
def kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """A Kubernetes API server for the session: WEIGHTROLL_KUBECONFIG or the built-in one."""
    external = os.environ.get("WEIGHTROLL_KUBECONFIG")
    if external:
        yield _external_cluster(external)
        return
    if apiserver_binary() is None:
        pytest.skip(f"kube-apiserver 1.20.2 is not built: {BUILD_HINT}")
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed: run `bash scripts/system-deps.sh` (apt etcd-server)")
    run_dir = tmp_path_factory.mktemp("kube-apiserver")
    cluster = start_apiserver(run_dir)
    try:
        yield cluster
    finally:
        stop_apiserver(run_dir)
