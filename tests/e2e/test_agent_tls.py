"""Issue 14 C, end to end: real vLLM pods whose agents serve TLS with the chart's certificate,
an operator that verifies it, and an agent-token rotation in the middle of a rollout.

The chart is installed with ``agentTLS.enabled`` (source ``helm``: the chart's own CA) and its
example workload; the operator gets the CA from the chart's Secret (``WEIGHTROLL_AGENT_CA_FILE``,
as the chart's Deployment mounts it) and re-reads the token Secret every second. Two pods.

The rotation follows the documented procedure while the rollout runs: ``old`` -> ``old\\nnew``
(every pod's file updated, like kubelet's sync) -> ``new\\nold`` (the operator now sends ``new``)
-> after the rollout, ``new`` alone. Acceptance: the rollout succeeds with no failed unit, the
agents answer only over verified TLS, and the old token is refused at the end.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from weightroll_dev.devcluster.workload import TOKEN_SECRET, WORKLOAD

from tests.e2e.tls_fleet import (
    FIRST_UPDATE,
    NAMESPACE,
    WORKLOAD_VALUES,
    Fleet,
    open_fleet,
)
from tests.harness.apiserver import KubeCluster, kubectl

pytestmark = [
    pytest.mark.engine,
    pytest.mark.server,
    pytest.mark.cluster,
    pytest.mark.timeout(1500),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

PODS = (f"{WORKLOAD}-0", f"{WORKLOAD}-1")
OLD, NEW = "e2e-token-not-secret", "rotated-token-not-secret"
SERVER_NAME = f"weightroll-agent.{NAMESPACE}.svc"


def _operator_env(cluster: KubeCluster) -> Any:
    def env(run: Path) -> dict[str, str]:
        data = kubectl(
            cluster, "get", "secret", "weightroll-agent-ca", "-n", NAMESPACE,
            "-o", "jsonpath={.data.ca\\.crt}",
        ).stdout  # fmt: skip
        ca = run / "agent-ca.crt"
        ca.write_bytes(base64.b64decode(data))
        return {"WEIGHTROLL_AGENT_CA_FILE": str(ca), "WEIGHTROLL_TOKEN_TTL": "1"}

    return env


@pytest.fixture(scope="module")
def tls_fleet(
    kube_cluster: KubeCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fleet]:
    values = {**WORKLOAD_VALUES, "agentTLS": {"enabled": True, "source": "helm"}}
    values["workloadExample"] = {**values["workloadExample"], "replicas": len(PODS)}
    with open_fleet(
        kube_cluster,
        tmp_path_factory.mktemp("e2e-tls"),
        values,
        PODS,
        cold=False,
        operator_env=_operator_env(kube_cluster),
    ) as fl:
        yield fl


def _agent_get(fl: Fleet, pod: str, token: str) -> int:
    """``GET /v1/state`` over TLS to the pod IP, verified as the operator does (the chart's CA,
    the agents' server name); returns the HTTP status."""
    ip = fl.sim.run(lambda: fl.sim.simulator.pod_ip(pod))
    ctx = ssl.create_default_context(cafile=str(fl.operator_log.parent / "agent-ca.crt"))
    request = (
        f"GET /v1/state HTTP/1.1\r\nHost: {ip}\r\nAuthorization: Bearer {token}\r\n"
        "Connection: close\r\n\r\n"
    )
    with (
        socket.create_connection((ip, 8470), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=SERVER_NAME) as conn,
    ):
        conn.sendall(request.encode())
        status_line = conn.makefile("rb").readline()
    return int(status_line.split()[1])


def _rotate(fl: Fleet, value: str) -> None:
    """Change the token Secret, then play kubelet's sync on every pod (atomic file swap)."""
    body = json.dumps({"stringData": {"token": value}})
    fl.kubectl("patch", "secret", TOKEN_SECRET, "-n", NAMESPACE, "--type=merge", "-p", body)
    for pod in PODS:
        fl.sim.call(fl.sim.simulator.refresh_secret_volumes, pod)


def test_tls_agents_and_a_token_rotation_without_a_failed_update(tls_fleet: Fleet) -> None:
    fl = tls_fleet
    # The agents serve only TLS with the chart's certificate, verified against the chart's CA.
    for pod in PODS:
        assert _agent_get(fl, pod, OLD) == 200
        ip = fl.sim.run(lambda p=pod: fl.sim.simulator.pod_ip(p))  # type: ignore[misc]
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://{ip}:8470/healthz", timeout=5)  # no plain HTTP
    # FIRST_UPDATE's checkpoint was published by open_fleet.
    fl.apply_weightupdate("tls", FIRST_UPDATE)
    _rotate(fl, f"{OLD}\n{NEW}")  # step 1: agents accept both; the operator still sends OLD
    deadline = time.monotonic() + 600
    while True:
        status = fl.weightupdate("tls").get("status") or {}
        if (status.get("replicas") or {}).get("updated", 0) >= 1:
            break
        assert status.get("phase") != "Failed", json.dumps(status, indent=1)
        assert time.monotonic() < deadline, fl.logs()
        time.sleep(1)
    _rotate(fl, f"{NEW}\n{OLD}")  # step 2: the operator sends NEW (token TTL 1 s)
    status = fl.wait_phase("tls", "Succeeded", "Failed", timeout=600)
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["replicas"]["failed"] == 0 and status["replicas"]["updated"] == len(PODS), status
    _rotate(fl, NEW)  # step 3: the old token is gone
    for pod in PODS:
        assert _agent_get(fl, pod, NEW) == 200
        assert _agent_get(fl, pod, OLD) == 401
        assert fl.condition(pod, "weightroll.io/weights-ready") == "True"
    log = fl.operator_log.read_text(errors="replace")
    # An agent's 401 is logged as "<pod>: <method> <path> -> 401: ..." (agent_client.py); a bare
    # "401" also matched log timestamps ("17:32:52,401 INFO ..."): a few runs in a hundred.
    assert "-> 401:" not in log and "CERTIFICATE_VERIFY_FAILED" not in log, fl.logs()
