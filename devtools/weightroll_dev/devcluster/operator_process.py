"""Running ``weightroll-operator`` as a local process against a (simulated) cluster.

Shared by the cluster demo and the cluster/e2e tests: the operator authenticates with a
ServiceAccount token (the chart's identity) through its own kubeconfig and binds its metrics
endpoint to loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from weightroll_dev.devcluster.apiserver import free_ports, run_kubectl

__all__ = [
    "RunningOperator",
    "launch_operator",
    "log_tail",
    "start_operator",
    "stop_process",
    "wait_authorized",
    "write_token_kubeconfig",
]


def write_token_kubeconfig(server: str, token: str, path: Path) -> Path:
    """Write a kubeconfig for ``server`` that authenticates with ``token`` (TLS not verified)."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "op", "user": {"token": token}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "op"}}],
                "current-context": "c",
            }
        )
    )
    return path


def launch_operator(
    kubeconfig: Path,
    log: Path,
    metrics_port: int,
    *extra: str,
    new_session: bool = False,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``weightroll-operator`` (1 s timer, metrics on 127.0.0.1) with output to ``log``.

    ``new_session`` keeps a terminal's Ctrl-C away from it (the caller stops it); ``env`` adds
    variables (``WEIGHTROLL_*``, ``POD_NAME``) to this process's environment.
    """
    with log.open("wb") as handle:
        return subprocess.Popen(
            [
                str(Path(sys.executable).parent / "weightroll-operator"),
                f"--kubeconfig={kubeconfig}",
                "--interval=1",
                f"--metrics-port={metrics_port}",
                "--health-port=0",
                *extra,
            ],
            env={
                **os.environ,
                "KUBECONFIG": str(kubeconfig),
                "WEIGHTROLL_METRICS_ADDR": "127.0.0.1",
                **(env or {}),
            },
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM, then SIGKILL after ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def log_tail(log: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of the operator's log, headed for an error message."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "operator log tail:\n" + "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class RunningOperator:
    """A started ``weightroll-operator`` whose metrics endpoint answered."""

    process: subprocess.Popen[bytes]
    log: Path
    metrics_url: str


def start_operator(
    kubeconfig: Path,
    log: Path,
    *extra: str,
    new_session: bool = False,
    timeout: float = 60,
    env: Mapping[str, str] | None = None,
) -> RunningOperator:
    """Launch the operator on a free metrics port and wait until ``/metrics`` answers.

    Raises:
        RuntimeError: the operator exited or did not answer within ``timeout`` seconds (the
            message carries its log tail); the process is stopped first.
    """
    (port,) = free_ports(1)
    proc = launch_operator(kubeconfig, log, port, *extra, new_session=new_session, env=env)
    url = f"http://127.0.0.1:{port}/metrics"
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return RunningOperator(proc, log, url)
        except (urllib.error.URLError, OSError):
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_process(proc)
                raise RuntimeError(f"the operator did not start: {log_tail(log)}") from None
            time.sleep(0.5)


def wait_authorized(
    kubeconfig: Path, namespace: str, service_account: str, timeout: float = 30
) -> bool:
    """Wait until ``service_account`` may patch pods/status in ``namespace`` (the chart's RBAC).

    The apiserver's authorizer learns new bindings from its informers a moment after a chart
    install; an operator started before that fails its first writes. Returns whether it did.
    """
    deadline = time.monotonic() + timeout
    while True:
        out = run_kubectl(
            kubeconfig,
            "auth",
            "can-i",
            "patch",
            "pods",
            "--subresource=status",
            "-n",
            namespace,
            f"--as=system:serviceaccount:{namespace}:{service_account}",
            timeout=30,
        ).stdout.strip()
        if out == "yes":
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
