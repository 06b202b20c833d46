"""Pod injection in the chart (issue 31 item 1): the webhook's registration, the operator's
settings, and one source of truth for the four pieces.

The example workload rendered with ``workloadExample.inject`` (label and annotations only), run
through the operator's injection with the settings the chart passes to the operator's
Deployment, must equal the example rendered by the hand-written ``weightroll.workload.*``
helpers: same readiness gate, flags, env, probes, mounts, securityContext and volumes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from weightroll_operator.domain.injection import INJECT_LABEL, InjectionSettings, Refusal, inject
from weightroll_operator.settings import OperatorConfig

from tests.charts.helpers import find, helm_python, objects, render, scenario_values
from tests.harness.jsonpatch import apply_patch


def _values(**workload: Any) -> dict[str, Any]:
    values = scenario_values("workload-values.yaml")
    values["workloadExample"].pop("trainerNetworks")  # not injected (refused with inject)
    values["workloadExample"].update(workload)
    return values


def _settings(objs: list[dict[str, Any]]) -> InjectionSettings:
    """What the chart tells the operator to inject (its Deployment's WEIGHTROLL_* variables)."""
    deploy = find(objs, "Deployment", "weightroll-operator")
    (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in ctr["env"] if e["name"].startswith("WEIGHTROLL_")}
    settings = OperatorConfig.from_env(env).injection()
    assert settings is not None
    return settings


def _template(objs: list[dict[str, Any]]) -> dict[str, Any]:
    template: dict[str, Any] = find(objs, "Deployment", "vllm-example")["spec"]["template"]
    return template


def _normal(spec: dict[str, Any]) -> dict[str, Any]:
    """Order-free where order means nothing: args of vLLM, env, volumes by name."""
    spec = copy.deepcopy(spec)
    for c in spec["containers"]:
        if c["name"] == "vllm":
            c["args"] = sorted(c["args"])
        c["env"] = sorted(c.get("env", []), key=lambda e: e["name"])
    spec["volumes"] = sorted(spec["volumes"], key=lambda v: v["name"])
    return spec


@pytest.mark.parametrize(
    "workload",
    [
        {},
        {"initialWeights": {"version": "v7", "source": "/models/v7", "manifest": "/models/m"}},
        {"vllm": {"model": "org/model", "port": 8001}},
    ],
    ids=["default", "initial-weights", "hub-model"],
)
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plain"])
def test_injected_example_equals_the_hand_written_one(workload: dict[str, Any], tls: bool) -> None:
    hand = objects(render(_values(**workload) | {"agentTLS": {"enabled": tls}}))
    labelled_values = _values(inject=True, **workload) | {"agentTLS": {"enabled": tls}}
    labelled = objects(render(labelled_values))
    pod = _template(labelled)
    assert pod["metadata"]["labels"][INJECT_LABEL] == "true"
    spec = pod["spec"]
    assert "readinessGates" not in spec
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    assert [v["name"] for v in spec["volumes"]] == ["models"]
    ops = inject(pod, _settings(labelled))
    assert not isinstance(ops, Refusal), ops
    injected = apply_patch(pod, ops)
    assert _normal(injected["spec"]) == _normal(_template(hand)["spec"])
    assert inject(injected, _settings(labelled)) == []


def test_mutating_webhook_is_registered_for_labelled_pods_only() -> None:
    objs = objects(render())
    config = find(objs, "MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["reinvocationPolicy"] == "IfNeeded"
    assert hook["objectSelector"] == {"matchLabels": {INJECT_LABEL: "true"}}
    assert "namespaceSelector" not in hook
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "operations": ["CREATE"],
            "scope": "Namespaced",
        }
    ]
    assert hook["clientConfig"]["service"] == {
        "name": "weightroll-webhook",
        "namespace": "weightroll-system",
        "path": "/mutate",
        "port": 443,
    }
    (validating,) = find(objs, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == validating["clientConfig"]["caBundle"]
    settings = _settings(objs)
    assert settings.agent_image == "ghcr.io/weightroll/weightroll-agent:0.1.0"
    assert settings.tls is True and settings.models_volume == "models"
    selector = {"matchLabels": {"weightroll.io/inference": "true"}}
    given = objects(render({"webhook": {"inject": {"namespaceSelector": selector}}}))
    (hook,) = find(given, "MutatingWebhookConfiguration")["webhooks"]
    assert hook["namespaceSelector"] == selector


@pytest.mark.parametrize(
    "values", [{"webhook": {"inject": {"enabled": False}}}, {"webhook": {"enabled": False}}]
)
def test_injection_off_registers_and_configures_nothing(values: dict[str, Any]) -> None:
    objs = objects(render(values))
    assert "MutatingWebhookConfiguration" not in {o["kind"] for o in objs}
    deploy = find(objs, "Deployment", "weightroll-operator")
    (ctr,) = deploy["spec"]["template"]["spec"]["containers"]
    assert not [e for e in ctr["env"] if e["name"].startswith("WEIGHTROLL_INJECT_")]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"webhook": {"inject": {"enabled": False}}}, "needs webhook.enabled"),
        ({"workloadExample": {"trainerNetworks": ["10.0.0.0/8"]}}, "does not inject"),
        ({"workloadExample": {"agent": {"extraArgs": ["--x"]}}}, "does not inject"),
    ],
)
def test_example_injection_refuses_what_it_cannot_prepare(
    values: dict[str, Any], message: str
) -> None:
    base = _values(inject=True)
    for key, part in values.items():
        base[key] = {**base.get(key, {}), **part}
    with pytest.raises(helm_python.HelmRenderError, match=message):
        render(base)


def test_dev_cluster_values_render_the_label_only_example() -> None:
    """``weightroll_dev dev up --inject`` (the e2e tier's injection test) installs these."""
    from weightroll_dev.devcluster.workload import workload_values

    objs = objects(render(workload_values("v1", "t", replicas=2, inject=True)))
    template = _template(objs)
    assert template["metadata"]["labels"][INJECT_LABEL] == "true"
    assert template["metadata"]["annotations"]["weightroll.io/initial-version"] == "v1"
    assert [c["name"] for c in template["spec"]["containers"]] == ["vllm"]
    find(objs, "MutatingWebhookConfiguration")
    ops = inject(template, _settings(objs))
    assert not isinstance(ops, Refusal), ops
    agent = apply_patch(template, ops)["spec"]["containers"][1]
    assert not any(a.startswith("--tls") for a in agent["args"])  # the dev cluster: plain HTTP
