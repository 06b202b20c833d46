"""Issue 28 item 5 in the chart: ``workloadExample.agent.manifestPublicKey`` mounts the
publisher's public key (a ConfigMap) into the agent alone and points
``WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY`` at it; unset, the agent accepts unsigned manifests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.charts.helpers import CHART, find, helm_python, objects, render, with_crd_fallback

KEY_ENV = "WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY"


def _pod(agent: dict[str, Any]) -> dict[str, Any]:
    values = {"workloadExample": {"enabled": True, "inject": False, "agent": agent}}
    spec: dict[str, Any] = find(objects(render(values)), "Deployment", "vllm-example")["spec"]
    return spec["template"]["spec"]  # type: ignore[no-any-return]


def _containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["containers"]}


def test_the_public_key_reaches_the_agent_only() -> None:
    pod = _pod({"manifestPublicKey": {"configMap": "publisher-key", "key": "ec.pub"}})
    agent, vllm = _containers(pod)["weightroll-agent"], _containers(pod)["vllm"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env[KEY_ENV] == "/var/run/weightroll-manifest-key/public.pem"
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["weightroll-manifest-key"] == {
        "name": "weightroll-manifest-key",
        "mountPath": "/var/run/weightroll-manifest-key",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["weightroll-manifest-key"]["configMap"] == {
        "name": "publisher-key",
        "items": [{"key": "ec.pub", "path": "public.pem"}],
    }
    assert "weightroll-manifest-key" not in {m["name"] for m in vllm.get("volumeMounts", [])}


def test_without_a_key_nothing_is_mounted() -> None:
    pod = _pod({})
    agent = _containers(pod)["weightroll-agent"]
    assert KEY_ENV not in {e["name"] for e in agent["env"]}
    assert "weightroll-manifest-key" not in {v["name"] for v in pod["volumes"]}


@pytest.mark.parametrize(
    ("field", "bad"), [("configMap", "Publisher_Key"), ("key", "../etc/key"), ("extra", "x")]
)
def test_schema_refuses_a_bad_key_reference(field: str, bad: str) -> None:
    chart = helm_python.Chart.load(str(CHART))
    try:
        values = {
            "workloadExample": {
                "enabled": True,
                "inject": False,
                "agent": {"manifestPublicKey": {field: bad}},
            }
        }
        with pytest.raises(helm_python.HelmValuesError, match="manifestPublicKey"):
            chart.validate_schema(with_crd_fallback(values))
    finally:
        chart.close()
