"""Issue 14 C in the chart: the agent channel's TLS material, the agent's bind address and the
NetworkPolicy that lets only the operator reach the agent port (rendered; kubernetes-validate
runs on the `security-values.yaml` scenario in test_manifests.py)."""

from __future__ import annotations

import base64
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.charts.helpers import NAMESPACE, find, objects, render, scenario_values

SERVER_NAME = f"weightroll-agent.{NAMESPACE}.svc"


def _agent(objs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "weightroll-agent")


def test_agent_binds_to_the_pod_ip_and_vllm_to_loopback() -> None:
    objs = objects(render({"workloadExample": {"enabled": True}}))
    agent = _agent(objs)
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in agent[
        "env"
    ]
    assert not any("--host" in a for a in agent["args"])  # the default is $POD_IP
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert "--host=127.0.0.1" in vllm["args"]
    token = find(objs, "Secret", "vllm-example-weightroll-token")
    assert token["metadata"]["labels"]["weightroll.io/agent-token"] == "true"


def test_network_policy_admits_only_the_operator_to_the_agent_port() -> None:
    objs = objects(render(scenario_values("security-values.yaml")))
    policy = find(objs, "NetworkPolicy")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "vllm-example"}}
    assert spec["policyTypes"] == ["Ingress"]
    agent_rule, open_rule = spec["ingress"]
    assert agent_rule["ports"] == [{"protocol": "TCP", "port": "weightroll"}]
    (peer,) = agent_rule["from"]
    operator_labels = find(objs, "Deployment", "weightroll-operator")["spec"]["selector"]
    assert peer["podSelector"] == operator_labels
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert open_rule == {"ports": [{"protocol": "TCP", "port": 8080}]}  # no `from`: anyone
    off = objects(
        render({"workloadExample": {"enabled": True}, "networkPolicy": {"enabled": False}})
    )
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]


def _pem(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def test_helm_generated_certificate_verifies_against_the_operator_ca(tmp_path: Path) -> None:
    objs = objects(render(scenario_values("security-values.yaml")))
    ca = find(objs, "Secret", "weightroll-agent-ca")
    tls = find(objs, "Secret", "vllm-example-weightroll-tls")
    assert tls["type"] == "kubernetes.io/tls"
    (tmp_path / "ca.crt").write_bytes(_pem(ca, "ca.crt"))
    (tmp_path / "tls.crt").write_bytes(_pem(tls, "tls.crt"))
    (tmp_path / "tls.key").write_bytes(_pem(tls, "tls.key"))
    proc = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    names = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tmp_path / "tls.crt")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"DNS:{SERVER_NAME}" in names
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
        tmp_path / "tls.crt", tmp_path / "tls.key"
    )
    # The operator trusts that CA (mounted) and the agent serves with that certificate.
    operator = find(objs, "Deployment", "weightroll-operator")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in operator["containers"][0]["env"]}
    assert env["WEIGHTROLL_AGENT_CA_FILE"] == "/etc/weightroll/agent-ca/ca.crt"
    (volume,) = [v for v in operator["volumes"] if v["name"] == "agent-ca"]
    assert volume["secret"] == {
        "secretName": "weightroll-agent-ca",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],  # never the CA key
    }
    agent = _agent(objs)
    assert "--tls-cert-file=/var/run/weightroll-tls/tls.crt" in agent["args"]
    assert agent["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"


@pytest.mark.parametrize("source", ["helm", "cert-manager"])
def test_tls_sources(source: str) -> None:
    values = {"workloadExample": {"enabled": True}, "agentTLS": {"enabled": True, "source": source}}
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects(render(values))}
    if source == "cert-manager":
        assert {
            ("Issuer", "weightroll-agent-selfsigned"),
            ("Certificate", "weightroll-agent-ca"),
            ("Issuer", "weightroll-agent-ca"),
            ("Certificate", "vllm-example-weightroll-tls"),
        } <= kinds
        cert = find(objects(render(values)), "Certificate", "vllm-example-weightroll-tls")
        assert cert["spec"]["dnsNames"] == [SERVER_NAME]
    else:
        assert {
            ("Secret", "weightroll-agent-ca"),
            ("Secret", "vllm-example-weightroll-tls"),
        } <= kinds
