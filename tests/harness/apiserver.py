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

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from weightroll_dev.devcluster.apiserver import (
    BUILD_HINT,
    OPERATOR_NAMESPACE,
    OPERATOR_SERVICEACCOUNT,
    REPO,
    SCRIPT,
    KubeCluster,
    apiserver_binary,
    run_kubectl,
    start_apiserver,
    stop_apiserver,
)

__all__ = [
    "BUILD_HINT",
    "OPERATOR_NAMESPACE",
    "OPERATOR_SERVICEACCOUNT",
    "REPO",
    "SCRIPT",
    "KubeCluster",
    "apiserver_binary",
    "kube_cluster",
    "kubectl",
    "service_account_token",
    "wait_for_phase",
    "start_apiserver",
    "stop_apiserver",
]


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
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    proc = run_kubectl(kubeconfig or cluster.kubeconfig, *args, input_=input_)
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def wait_for_phase(
    read: Callable[[], dict[str, Any]],
    phases: tuple[str, ...],
    *,
    timeout: float,
    alive: Callable[[], bool],
    describe: Callable[[], str],
) -> dict[str, Any]:
    """Poll the object ``read`` returns until its status is about its current spec and its
    phase is one of ``phases``; return that status.

    A status whose ``observedGeneration`` is not the object's ``metadata.generation`` is the
    verdict on an earlier spec: right after a spec change it still shows the old phase, and a
    test that read it would judge the new spec by the old rollout.

    Raises:
        AssertionError: after ``timeout`` s, or once ``alive()`` is false, with the last status
            and ``describe()``.
    """
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = read()
        status = body.get("status") or {}
        current = status.get("observedGeneration") == (body.get("metadata") or {}).get("generation")
        if current and status.get("phase") in phases:
            return status
        if not alive():
            break
        time.sleep(1)
    raise AssertionError(
        f"not in {phases} for the current generation after {timeout}s: "
        f"{json.dumps(status, indent=1)}\n{describe()}"
    )


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
