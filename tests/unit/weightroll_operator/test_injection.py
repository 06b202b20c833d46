"""Pod injection (``domain/injection.py``): table tests, an exact golden, and properties.

Properties: a pod without the opt-in label gets no operation; injecting an injected pod adds
nothing; only ``add`` operations, so nothing the owner wrote changes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from weightroll_operator.domain.injection import (
    AGENT_CONTAINER,
    INJECT_LABEL,
    READINESS_GATE,
    InjectionSettings,
    Refusal,
    inject,
)

from tests.harness.jsonpatch import apply_patch

SETTINGS = InjectionSettings(
    agent_image="agent:1",
    token_secret="tok",
    tls=True,
    tls_secret="tls",
    agent_resources={"limits": {"memory": "256Mi"}},
)


def _pod(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "containers": [
            {
                "name": "vllm",
                "image": "vllm:1",
                "command": ["vllm", "serve"],
                "args": ["/models/current", "--port=8001"],
                "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
            }
        ],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
    }
    body.update(spec)
    return {
        "metadata": {"labels": {INJECT_LABEL: "true"}, "annotations": {}},
        "spec": body,
    }


def _injected(pod: dict[str, Any], s: InjectionSettings = SETTINGS) -> dict[str, Any]:
    ops = inject(pod, s)
    assert not isinstance(ops, Refusal), ops
    return apply_patch(pod, ops)


def test_golden_injected_pod() -> None:
    pod = _injected(_pod())
    spec = pod["spec"]
    assert spec["readinessGates"] == [{"conditionType": READINESS_GATE}]
    vllm, agent = spec["containers"]
    assert vllm["args"] == [
        "/models/current",
        "--port=8001",
        "--host=127.0.0.1",
        "--worker-extension-cls=engine_agent.vllm_extension.WeightRollExtension",
    ]
    assert vllm["env"] == [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}]
    assert agent == {
        "name": AGENT_CONTAINER,
        "image": "agent:1",
        "command": ["weightroll-agent"],
        "args": [
            "--vllm-url=http://127.0.0.1:8001",
            "--token-file=/var/run/weightroll/token",
            "--state-dir=/var/lib/weightroll",
            "--tls-cert-file=/var/run/weightroll-tls/tls.crt",
            "--tls-key-file=/var/run/weightroll-tls/tls.key",
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "WEIGHTROLL_AGENT_MODEL_DIR", "value": "/models"},
            {"name": "WEIGHTROLL_AGENT_INITIAL_SOURCE", "value": "/models/current"},
        ],
        "ports": [{"name": "weightroll", "containerPort": 8470}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "weightroll", "scheme": "HTTPS"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "weightroll", "scheme": "HTTPS"},
            "periodSeconds": 15,
            "failureThreshold": 4,
        },
        "volumeMounts": [
            {"name": "weightroll-token", "mountPath": "/var/run/weightroll", "readOnly": True},
            {"name": "weightroll-tls", "mountPath": "/var/run/weightroll-tls", "readOnly": True},
            {"name": "weightroll-state", "mountPath": "/var/lib/weightroll"},
            {"name": "models", "mountPath": "/models", "readOnly": True},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "resources": {"limits": {"memory": "256Mi"}},
    }
    assert [v["name"] for v in spec["volumes"]] == [
        "models",
        "weightroll-token",
        "weightroll-tls",
        "weightroll-state",
    ]
    assert spec["volumes"][1]["secret"] == {
        "secretName": "tok",
        "defaultMode": 0o400,
        "items": [{"key": "token", "path": "token"}],
    }
    assert spec["volumes"][2]["secret"]["secretName"] == "tls"


def test_plain_http_without_tls_and_annotations_override_settings() -> None:
    pod = _pod()
    pod["metadata"]["annotations"] = {
        "weightroll.io/agent-token-secret": "mine",
        "weightroll.io/initial-version": "v1",
        "weightroll.io/initial-source": "/models/v1",
        "weightroll.io/initial-manifest": "/models/v1/m.json",
    }
    plain = InjectionSettings(agent_image="agent:1", token_secret="tok")
    spec = _injected(pod, plain)["spec"]
    agent = spec["containers"][1]
    assert not any(a.startswith("--tls") for a in agent["args"])
    assert "scheme" not in agent["readinessProbe"]["httpGet"]
    assert "resources" not in agent
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["WEIGHTROLL_AGENT_INITIAL_VERSION"] == "v1"
    assert env["WEIGHTROLL_AGENT_INITIAL_SOURCE"] == "/models/v1"
    assert env["WEIGHTROLL_AGENT_INITIAL_MANIFEST"] == "/models/v1/m.json"
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "weightroll-tls" not in volumes
    assert volumes["weightroll-token"]["secret"]["secretName"] == "mine"


def test_named_container_volume_and_separate_port_flag() -> None:
    pod = _pod(
        containers=[
            {"name": "proxy", "image": "envoy"},
            {
                "name": "engine",
                "image": "vllm:1",
                "command": ["vllm", "serve", "org/model", "--port", "9000", "--host", "0.0.0.0"],
                "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
                "env": [{"name": "A", "value": "b"}],
            },
        ],
        volumes=[{"name": "ckpt", "emptyDir": {}}],
        readinessGates=[{"conditionType": "other"}],
    )
    pod["metadata"]["annotations"] = {
        "weightroll.io/vllm-container": "engine",
        "weightroll.io/models-volume": "ckpt",
    }
    spec = _injected(pod)["spec"]
    engine = spec["containers"][1]
    # the owner's --host stays (no second one); the extension is added as args
    assert engine["args"] == [
        "--worker-extension-cls=engine_agent.vllm_extension.WeightRollExtension"
    ]
    assert engine["env"][0] == {"name": "A", "value": "b"}
    agent = spec["containers"][2]
    assert agent["args"][0] == "--vllm-url=http://127.0.0.1:9000"
    assert agent["volumeMounts"][-1] == {"name": "ckpt", "mountPath": "/ckpt", "readOnly": True}
    # a model named by hub id is no path to restore from
    assert [e["name"] for e in agent["env"]] == ["POD_IP", "WEIGHTROLL_AGENT_MODEL_DIR"]
    assert spec["readinessGates"] == [{"conditionType": "other"}, {"conditionType": READINESS_GATE}]


REFUSED = [
    (lambda p: p["spec"]["containers"][0].update(name="engine"), "vLLM container not found"),
    (
        lambda p: p["metadata"]["annotations"].update({"weightroll.io/vllm-container": "x"}),
        "no container named 'x'",
    ),
    (lambda p: p["spec"].update(volumes=[]), "no checkpoint volume"),
    (lambda p: p["spec"]["containers"][0].update(volumeMounts=[]), "no checkpoint volume"),
    (
        lambda p: p["metadata"]["annotations"].update({"weightroll.io/models-volume": "ckpt"}),
        "mounts no pod volume named 'ckpt'",
    ),
]


@pytest.mark.parametrize(("breaks", "message"), REFUSED)
def test_a_pod_that_cannot_be_completed_is_refused_naming_the_piece(
    breaks: Any, message: str
) -> None:
    pod = _pod()
    breaks(pod)
    outcome = inject(pod, SETTINGS)
    assert isinstance(outcome, Refusal) and message in outcome.message


def test_missing_secrets_are_refused_naming_the_annotation() -> None:
    no_token = InjectionSettings(agent_image="a", tls=False)
    outcome = inject(_pod(), no_token)
    assert isinstance(outcome, Refusal)
    assert "weightroll.io/agent-token-secret" in outcome.message
    no_tls = InjectionSettings(agent_image="a", token_secret="t", tls=True)
    outcome = inject(_pod(), no_tls)
    assert isinstance(outcome, Refusal)
    assert "weightroll.io/agent-tls-secret" in outcome.message


def test_settings_need_an_agent_image() -> None:
    with pytest.raises(ValueError, match="agent image"):
        InjectionSettings(agent_image="")


@pytest.mark.parametrize("label", [None, "false", "yes", ""])
def test_a_pod_without_the_opt_in_label_is_never_touched(label: str | None) -> None:
    pod = _pod()
    if label is None:
        del pod["metadata"]["labels"][INJECT_LABEL]
    else:
        pod["metadata"]["labels"][INJECT_LABEL] = label
    assert inject(pod, SETTINGS) == []
    # not even refused: an unlabelled pod that could not be completed is none of our business
    pod["spec"]["containers"] = []
    assert inject(pod, SETTINGS) == []


def test_settings_are_not_shared_between_pods() -> None:
    first = _injected(_pod())
    first["spec"]["containers"][1]["securityContext"]["capabilities"]["drop"].append("X")
    first["spec"]["containers"][1]["resources"]["limits"]["memory"] = "1Gi"
    second = _injected(_pod())
    assert second["spec"]["containers"][1]["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert SETTINGS.agent_resources == {"limits": {"memory": "256Mi"}}


# -- properties ------------------------------------------------------------------------------

_names = st.sampled_from(["vllm", "engine", "proxy", "weightroll-agent"])
_FLAGS = ["--host=0.0.0.0", "--port=9000", "--max-model-len=64", "--host", "127.0.0.1",
          "--worker-extension-cls=x.Y", "--port"]  # fmt: skip
_ENV = [{"name": "VLLM_SERVER_DEV_MODE", "value": "0"}, {"name": "A", "value": "1"}]
_VOLUMES = [{"name": "models", "emptyDir": {}}, {"name": "weightroll-state", "emptyDir": {}}]
_GATES = [{"conditionType": READINESS_GATE}, {"conditionType": "x"}]
_flags = st.lists(st.sampled_from(_FLAGS), max_size=5)


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    """Pods of every shape the rules look at: labelled or not, pieces present or not."""
    containers = []
    for name in draw(st.lists(_names, max_size=3, unique=True)):
        c: dict[str, Any] = {"name": name, "image": "i"}
        if draw(st.booleans()):
            c["command"] = ["vllm", "serve", draw(st.sampled_from(["/models/a", "org/m"]))]
        if draw(st.booleans()):
            c["args"] = draw(_flags)
        if draw(st.booleans()):
            c["env"] = draw(st.lists(st.sampled_from(_ENV), max_size=2))
        if draw(st.booleans()):
            c["volumeMounts"] = [{"name": "models", "mountPath": "/m"}]
        containers.append(c)
    spec: dict[str, Any] = {"containers": containers}
    if draw(st.booleans()):
        volumes = st.lists(st.sampled_from(_VOLUMES), max_size=2, unique_by=lambda v: v["name"])
        spec["volumes"] = draw(volumes)
    if draw(st.booleans()):
        spec["readinessGates"] = draw(st.lists(st.sampled_from(_GATES), max_size=2, unique_by=str))
    labels = draw(st.sampled_from([{}, {INJECT_LABEL: "true"}, {INJECT_LABEL: "false"}]))
    return {"metadata": {"labels": labels}, "spec": spec}


_settings = st.builds(
    InjectionSettings,
    agent_image=st.just("a:1"),
    token_secret=st.sampled_from(["", "tok"]),
    tls=st.booleans(),
    tls_secret=st.sampled_from(["", "tls"]),
)


@settings(max_examples=300, deadline=None)
@given(pods(), _settings)
def test_injection_is_idempotent_and_only_adds(pod: dict[str, Any], s: InjectionSettings) -> None:
    before = copy.deepcopy(pod)
    outcome = inject(pod, s)
    assert pod == before, "inject() must not change its input"
    if pod["metadata"]["labels"].get(INJECT_LABEL) != "true":
        assert outcome == []
        return
    if isinstance(outcome, Refusal):
        assert outcome.message
        return
    assert all(op["op"] == "add" for op in outcome)
    injected = apply_patch(pod, outcome)  # raises if an add would replace a member
    assert inject(injected, s) == [], "re-admission must add nothing"
    names = [c["name"] for c in injected["spec"]["containers"]]
    assert len(names) == len(set(names)) and AGENT_CONTAINER in names
    volumes = [v["name"] for v in injected["spec"]["volumes"]]
    assert len(volumes) == len(set(volumes))
    gates = [g["conditionType"] for g in injected["spec"]["readinessGates"]]
    assert gates.count(READINESS_GATE) == 1


def test_a_prepared_pod_needs_no_secret_names() -> None:
    """Re-admission of an injected pod whose Secrets came from settings no longer set."""
    injected = _injected(_pod())
    bare = InjectionSettings(agent_image="other", tls=True)
    assert inject(injected, bare) == []
