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
- ``audited_kube_cluster`` (module scope) starts a second built-in apiserver of its own with the
  audit log on (:func:`audit_args`: every request at ``Metadata`` level, no bodies) and yields an
  :class:`AuditedCluster`; :meth:`AuditedCluster.requests` reads who did what. It skips with an
  external cluster (its audit log is not ours to read).
- When the apiserver binary is not built, every test using the fixture is skipped with the command
  that builds it (``bash scripts/kube-apiserver.sh build``, ≈9-17 min on 2 cores, cached in
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
from dataclasses import dataclass
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
    "AUDIT_POLICY",
    "BUILD_HINT",
    "OPERATOR_NAMESPACE",
    "OPERATOR_SERVICEACCOUNT",
    "REPO",
    "SCRIPT",
    "AuditedCluster",
    "AuditedRequest",
    "KubeCluster",
    "apiserver_binary",
    "audit_args",
    "audited_kube_cluster",
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


#: Audit policy of :func:`audit_args`: every request of every user at ``Metadata`` level (user,
#: verb, resource, subresource, namespace, name, response code; never a body). Only the
#: ``RequestReceived`` stage is left out: a watch is logged when its response starts, so it is
#: seen while it is still open.
AUDIT_POLICY: dict[str, Any] = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata"}],
}


def audit_args(run_dir: Path) -> tuple[list[str], Path]:
    """kube-apiserver flags that write the audit log of :data:`AUDIT_POLICY` into ``run_dir``.

    Returns:
        The flags (for ``start_apiserver(run_dir, extra_args=...)``) and the log's path (one JSON
        ``audit.k8s.io/v1`` Event per line).
    """
    policy = run_dir / "audit-policy.json"
    policy.write_text(json.dumps(AUDIT_POLICY))
    log = run_dir / "audit.log"
    flags = [
        f"--audit-policy-file={policy}",
        f"--audit-log-path={log}",
        "--audit-log-format=json",
        # Written as each request completes, not batched: a test reads it right after the run.
        "--audit-log-mode=blocking",
        "--audit-log-maxbackup=0",
    ]
    return flags, log


@dataclass(frozen=True, slots=True)
class AuditedRequest:
    """One API request as the audit log records it (resource requests only)."""

    user: str
    verb: str
    #: API group, ``""`` for the core group.
    group: str
    resource: str
    #: ``""`` for the resource itself.
    subresource: str
    namespace: str
    name: str
    code: int


@dataclass(frozen=True, slots=True)
class AuditedCluster:
    """A built-in apiserver with its audit log (:func:`audit_args`)."""

    cluster: KubeCluster
    audit_log: Path

    def mark(self) -> int:
        """The log's current size: pass it to :meth:`requests` to read only what follows."""
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def requests(self, user: str, since: int = 0) -> list[AuditedRequest]:
        """Every resource request of ``user`` logged after byte ``since`` (one per audit ID).

        Requests without an ``objectRef`` (discovery, ``/version``, ``/readyz``: non-resource
        URLs, which no Role can grant) are left out.
        """
        seen: dict[str, AuditedRequest] = {}
        with self.audit_log.open("rb") as handle:
            handle.seek(since)
            for line in handle:
                event = json.loads(line)
                ref = event.get("objectRef")
                if event.get("user", {}).get("username") != user or not ref:
                    continue
                seen[event["auditID"]] = AuditedRequest(
                    user=user,
                    verb=event["verb"],
                    group=ref.get("apiGroup", ""),
                    resource=ref.get("resource", ""),
                    subresource=ref.get("subresource", ""),
                    namespace=ref.get("namespace", ""),
                    name=ref.get("name", ""),
                    code=int((event.get("responseStatus") or {}).get("code", 0)),
                )
        return list(seen.values())


@pytest.fixture(scope="module")
def audited_kube_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuditedCluster]:
    """A built-in kube-apiserver of its own with the audit log on, for one test module."""
    if os.environ.get("WEIGHTROLL_KUBECONFIG"):
        pytest.skip(
            "reads the audit log of the built-in kube-apiserver; WEIGHTROLL_KUBECONFIG is set"
        )
    if apiserver_binary() is None:
        pytest.skip(f"kube-apiserver 1.20.2 is not built: {BUILD_HINT}")
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed: run `bash scripts/system-deps.sh` (apt etcd-server)")
    run_dir = tmp_path_factory.mktemp("kube-apiserver-audited")
    flags, log = audit_args(run_dir)
    cluster = start_apiserver(run_dir, extra_args=flags)
    try:
        yield AuditedCluster(cluster, log)
    finally:
        stop_apiserver(run_dir)
