"""Issue 14 C in the chart: the agent channel's TLS material, the agent's bind address and the
NetworkPolicy that lets only the operator reach the agent port (rendered; kubernetes-validate
runs on the `security-values.yaml` scenario in test_manifests.py). Issue 28 item 8: agent TLS on
by default, the operator pods' own NetworkPolicy, and the restricted Pod Security Standard for
the example workload (tests/charts/pss.py)."""

from __future__ import annotations

import base64
import copy
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.charts.helpers import NAMESPACE, find, objects, render, scenario_values
from tests.charts.pss import restricted_violations

SERVER_NAME = f"weightroll-agent.{NAMESPACE}.svc"


def _agent(objs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "weightroll-agent")


def test_agent_binds_to_the_pod_ip_and_vllm_to_loopback() -> None:
    objs = objects(render({"workloadExample": {"enabled": True, "inject": False}}))
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
    policy = find(objs, "NetworkPolicy", "vllm-example-weightroll-agent")
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
        render(
            {
                "workloadExample": {"enabled": True, "inject": False},
                "networkPolicy": {"enabled": False},
            }
        )
    )
    assert not [o for o in off if o["metadata"]["name"] == "vllm-example-weightroll-agent"]


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
    values = {
        "workloadExample": {"enabled": True, "inject": False},
        "agentTLS": {"enabled": True, "source": source},
    }
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


def test_agent_tls_is_on_by_default() -> None:
    """Issue 28 item 8: with the chart's defaults the operator requires agent certificates from
    the chart's CA (no plain-HTTP fallback), and the example workload serves TLS; plain HTTP is
    an explicit opt-out, which the local demo takes (devtools ``workload_values``)."""
    from weightroll_dev.devcluster.workload import workload_values

    objs = objects(render())
    find(objs, "Secret", "weightroll-agent-ca")
    operator = find(objs, "Deployment", "weightroll-operator")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in operator["containers"][0]["env"]}
    assert env["WEIGHTROLL_AGENT_CA_FILE"] == "/etc/weightroll/agent-ca/ca.crt"
    example = objects(render({"workloadExample": {"enabled": True, "inject": False}}))
    find(example, "Secret", "vllm-example-weightroll-tls")
    agent = _agent(example)
    assert "--tls-cert-file=/var/run/weightroll-tls/tls.crt" in agent["args"]
    assert agent["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"

    off = objects(render({"agentTLS": {"enabled": False}}))
    operator = find(off, "Deployment", "weightroll-operator")["spec"]["template"]["spec"]
    assert "WEIGHTROLL_AGENT_CA_FILE" not in {e["name"] for e in operator["containers"][0]["env"]}
    assert workload_values("v1", "t")["agentTLS"] == {"enabled": False}


def _ports(rule: dict[str, Any]) -> set[tuple[str, Any]]:
    return {(p["protocol"], p["port"]) for p in rule["ports"]}


def test_operator_network_policy() -> None:
    """Issue 28 item 8: the operator pods' NetworkPolicy admits traffic only to the ports the
    operator serves and lets out only API server, agent-port and DNS traffic."""
    objs = objects(render())
    policy = find(objs, "NetworkPolicy", "weightroll-operator")
    spec = policy["spec"]
    operator = find(objs, "Deployment", "weightroll-operator")
    assert spec["podSelector"] == operator["spec"]["selector"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    served = {p["name"] for p in operator["spec"]["template"]["spec"]["containers"][0]["ports"]}
    probes_and_webhook, metrics = spec["ingress"]
    assert "from" not in probes_and_webhook  # kubelet and API server: node addresses
    assert _ports(probes_and_webhook) == {("TCP", "health"), ("TCP", "webhook")}
    assert _ports(metrics) == {("TCP", "metrics")} and "from" not in metrics
    assert {port for rule in spec["ingress"] for _, port in _ports(rule)} == served
    api, agents, dns = spec["egress"]
    assert _ports(api) == {("TCP", 443), ("TCP", 6443)} and "to" not in api
    assert _ports(agents) == {("TCP", 8470)}
    assert agents["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}}
    ]
    assert _ports(dns) == {("UDP", 53), ("TCP", 53)}
    assert dns["to"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}
    ]

    prometheus = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    values = {
        "operator": {
            "watchNamespaces": ["ml", "team-b"],
            "networkPolicy": {"metricsFrom": prometheus},
        },
        "webhook": {"enabled": False},
    }
    spec = find(objects(render(values)), "NetworkPolicy", "weightroll-operator")["spec"]
    probes, metrics = spec["ingress"]
    assert _ports(probes) == {("TCP", "health")}
    assert metrics["from"] == prometheus
    assert [p["namespaceSelector"]["matchLabels"] for p in spec["egress"][1]["to"]] == [
        {"kubernetes.io/metadata.name": "ml"},
        {"kubernetes.io/metadata.name": "team-b"},
    ]
    wide = objects(render({"operator": {"clusterWide": True}}))
    spec = find(wide, "NetworkPolicy", "weightroll-operator")["spec"]
    assert spec["egress"][1]["to"] == [{"namespaceSelector": {}}]
    off = objects(render({"operator": {"networkPolicy": {"enabled": False}}}))
    assert not [o for o in off if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize(
    "values",
    [
        {"workloadExample": {"enabled": True, "inject": False}},
        scenario_values("workload-values.yaml"),
        scenario_values("security-values.yaml"),
        {"workloadExample": {"enabled": True, "inject": False}, "agentTLS": {"enabled": False}},
    ],
)
def test_example_workload_passes_the_restricted_pod_security_standard(
    values: dict[str, Any],
) -> None:
    """Issue 28 item 8: the example vLLM workload (and the operator) would be admitted in a
    namespace enforcing ``pod-security.kubernetes.io/enforce: restricted``."""
    objs = objects(render(values))
    for name in ("vllm-example", "weightroll-operator"):
        template = find(objs, "Deployment", name)["spec"]["template"]
        annotations = template.get("metadata", {}).get("annotations")
        assert restricted_violations(template["spec"], annotations) == [], name


def test_pod_security_check_catches_what_restricted_refuses() -> None:
    """The check above is not a no-op: the vLLM container as it was before issue 28 (no
    securityContext of its own) and the usual escalations are reported."""
    objs = objects(render({"workloadExample": {"enabled": True, "inject": False}}))
    spec = copy.deepcopy(find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"])
    vllm = next(c for c in spec["containers"] if c["name"] == "vllm")
    del vllm["securityContext"]
    found = restricted_violations(spec)
    assert found == [
        "containers[vllm].securityContext.allowPrivilegeEscalation must be false",
        "containers[vllm].securityContext.capabilities.drop must contain ALL",
    ]
    del spec["securityContext"]["seccompProfile"]
    spec["hostNetwork"] = True
    spec["volumes"].append({"name": "root", "hostPath": {"path": "/"}})
    vllm["securityContext"] = {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}}
    found = restricted_violations(spec)
    for needle in (
        "spec.hostNetwork=true",
        "volumes[root].hostPath",
        "containers[vllm].securityContext.privileged=true",
        "containers[vllm].securityContext.capabilities.add=['SYS_ADMIN']",
        "containers[vllm].securityContext.seccompProfile.type must be",
    ):
        assert any(line.startswith(needle) for line in found), (needle, found)
