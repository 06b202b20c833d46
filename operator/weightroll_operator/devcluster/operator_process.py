"""Running ``weightroll operator`` as a local process against a (simulated) cluster.

Shared by the cluster demo and the cluster/e2e tests: the operator authenticates with a
ServiceAccount token (the chart's identity) through its own kubeconfig and binds its metrics
endpoint to loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

__all__ = ["launch_operator", "stop_process", "write_token_kubeconfig"]


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
) -> subprocess.Popen[bytes]:
    """Start ``weightroll operator`` (1 s timer, metrics on 127.0.0.1) with output to ``log``.

    ``new_session`` keeps a terminal's Ctrl-C away from it (the caller stops it).
    """
    with log.open("wb") as handle:
        return subprocess.Popen(
            [
                str(Path(sys.executable).parent / "weightroll"),
                "operator",
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
