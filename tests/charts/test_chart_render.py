"""Chart tier: render, lint, schema, RBAC, probes, alerts and the workload example, offline.

helm-python-sdk (the Helm v4 SDK) renders ``charts/weightroll`` for the default values and every
``ci/*-values.yaml`` scenario; assertions are made on the parsed manifests.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_operator.settings import OperatorConfig

from tests.charts.helpers import (
    ALERTS,
    CHART,
    CRD_FILE,
    NAMESPACE,
    REPO,
    SCENARIOS,
    find,
    helm_python,
    needs_crd,
    objects,
    render,
    scenario_values,
    with_crd_fallback,
)
from tests.harness.apiserver import OPERATOR_SERVICEACCOUNT


def _lint(values: dict[str, Any], chart: Path = CHART) -> dict[str, Any]:
    report: dict[str, Any] = helm_python.lint(
        str(chart), with_crd_fallback(values), strict=True, kube_version="v1.29.0"
    )
    return report


@pytest.mark.parametrize("scenario", ["(defaults)", *SCENARIOS])
def test_renders_and_lints(scenario: str) -> None:
    values = {} if scenario == "(defaults)" else scenario_values(scenario)
    rendered = render(values)
    objs = objects(rendered)
    find(objs, "Deployment", "weightroll-operator")
    report = _lint(values)
    findings = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and findings == [], report


def test_at_least_two_ci_scenarios() -> None:
    assert "default-values.yaml" in SCENARIOS
    assert len(SCENARIOS) >= 3, SCENARIOS


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"replicas": -1}}, "at '/operator/replicas': minimum"),
        ({"webhook": {"failurePolicy": "Maybe"}}, "at '/webhook/failurePolicy'"),
        (
            {"operator": {"leaderElection": {"enabled": True, "leaseSeconds": 1}}},
            "at '/operator/leaderElection/leaseSeconds': minimum",
        ),
        ({"imagee": {"tag": "x"}}, "additional properties 'imagee' not allowed"),
        ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
        ({"operator": {"ports": {"health": 0}}}, "at '/operator/ports/health': minimum"),
        ({"operator": {"watchNamespaces": ["Bad_NS"]}}, "at '/operator/watchNamespaces/0'"),
        (
            {"prometheusRule": {"customRules": {"WeightrollUpdateStuck": {"for": "5 minutes"}}}},
            "at '/prometheusRule/customRules/WeightrollUpdateStuck/for'",
        ),
        (
            {"prometheusRule": {"customRules": {"WeightrollFleetStale": {"severity": "page"}}}},
            "at '/prometheusRule/customRules/WeightrollFleetStale/severity'",
        ),
        (
            {"prometheusRule": {"disabled": {"WeightrollUpdateFailed": "yes"}}},
            "at '/prometheusRule/disabled/WeightrollUpdateFailed': got string, want boolean",
        ),
        ({"prometheusRule": {"disabled": {"WeightTypo": True}}}, "'WeightTypo' not allowed"),
        ({"installCRDs": "true"}, "at '/installCRDs': got string, want boolean"),
        (
            {"operator": {"admitUnmanagedPods": "false"}},
            "at '/operator/admitUnmanagedPods': got string, want boolean",
        ),
        ({"workloadExample": {"vllm": {"port": 8470}}}, "at '/workloadExample/vllm/port'"),
        ({"rbac": {"agentTokenSecretNames": [""]}}, "at '/rbac/agentTokenSecretNames/0'"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], message: str) -> None:
    chart = helm_python.Chart.load(str(CHART))
    try:
        with pytest.raises(helm_python.HelmValuesError) as err:
            chart.validate_schema(values)
        assert message in str(err.value)
        with pytest.raises(helm_python.HelmValuesError):
            chart.render(with_crd_fallback(values), name="weightroll", namespace="x")
    finally:
        chart.close()


def test_every_value_has_a_doc_comment() -> None:
    """A11: `# --` on every key of values.yaml (list items excepted)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        if not re.match(r"^\s*[A-Za-z][\w.-]*:", line):
            continue
        j = i - 1
        block: list[str] = []
        while j >= 0 and lines[j].strip().startswith("#"):
            block.append(lines[j].strip())
            j -= 1
        if not any(c.startswith("# --") for c in block):
            missing.append(f"values.yaml:{i + 1}: {line.strip()}")
    assert missing == []


#: What the operator does inside each namespace it handles (weightroll.rbacNamespacedRules), as
#: the audit log of a real run shows it (tests/charts/test_rbac_audit_cluster.py): no `get`.
NAMESPACED = {
    *(("weightroll.io", "weightupdates", v) for v in ("list", "watch", "patch")),
    ("weightroll.io", "weightupdates/status", "patch"),
    *(("", "pods", v) for v in ("list", "watch", "patch")),
    ("", "pods/status", "patch"),
    *(("", "events", v) for v in ("create", "patch")),
    ("", "secrets", "get"),
}
CRD_READ = {("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")}
NAMESPACE_READ = {("", "namespaces", v) for v in ("list", "watch")}


def _granted(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


@pytest.mark.parametrize(
    ("operator", "cluster", "roles"),
    [
        ({}, None, [NAMESPACE]),
        ({"watchNamespaces": ["ml", "team-b"]}, None, ["ml", "team-b"]),
        ({"watchNamespaces": ["ml-*"]}, NAMESPACED | CRD_READ | NAMESPACE_READ, []),
        ({"watchNamespaces": ["ml", "!kube-system"]}, NAMESPACED | CRD_READ | NAMESPACE_READ, []),
        ({"clusterWide": True}, NAMESPACED | CRD_READ, []),
    ],
)
def test_rbac_is_per_namespace_when_namespaces_are_named(
    operator: dict[str, Any], cluster: set[tuple[str, str, str]] | None, roles: list[str]
) -> None:
    """Issue 14 A, issue 28 item 7: plain watched namespaces (by default the release namespace
    alone) get a Role + RoleBinding each and no ClusterRole (kopf's scanning is off then); a glob
    or the explicit `operator.clusterWide` puts the rules into a ClusterRole."""
    objs = objects(render({"operator": operator}))
    if cluster is None:
        assert not _operator_cluster_rbac(objs)
    else:
        assert _granted(find(objs, "ClusterRole", "weightroll-operator")) == cluster
    found = [
        o for o in objs if o["kind"] == "Role" and o["metadata"]["name"] == "weightroll-operator"
    ]
    assert sorted(o["metadata"]["namespace"] for o in found) == roles
    for role in found:
        assert _granted(role) == NAMESPACED
        (binding,) = [
            o
            for o in objs
            if o["kind"] == "RoleBinding"
            and o["metadata"]["namespace"] == role["metadata"]["namespace"]
            and o["metadata"]["name"] == "weightroll-operator"
        ]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": OPERATOR_SERVICEACCOUNT, "namespace": NAMESPACE}
        ]


def test_rbac_is_least_privilege() -> None:
    """By default the operator watches the release namespace alone: a Role there, no
    ClusterRole (issue 28 item 7); cluster-wide is the explicit `operator.clusterWide`."""
    objs = objects(render())
    assert not _operator_cluster_rbac(objs)
    role = find(objs, "Role", "weightroll-operator")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert _granted(role) == NAMESPACED
    assert not any("*" in str(rule) for rule in role["rules"])
    assert not any("kopf" in str(rule) for rule in role["rules"]), "no peering objects"
    binding = find(objs, "RoleBinding", "weightroll-operator")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": OPERATOR_SERVICEACCOUNT,
            "namespace": "weightroll-system",
        }
    ]
    sa = find(objs, "ServiceAccount")
    assert sa["metadata"]["name"] == OPERATOR_SERVICEACCOUNT


def test_cluster_wide_and_named_namespaces_exclude_each_other() -> None:
    values = {"operator": {"clusterWide": True, "watchNamespaces": ["ml"]}}
    with pytest.raises(helm_python.HelmRenderError, match="clusterWide"):
        render(values)


def test_secret_access_can_be_narrowed_to_names() -> None:
    objs = objects(render({"rbac": {"agentTokenSecretNames": ["tok-a", "tok-b"]}}))
    role = find(objs, "Role", "weightroll-operator")
    (secrets,) = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secrets == {
        "apiGroups": [""],
        "resources": ["secrets"],
        "verbs": ["get"],
        "resourceNames": ["tok-a", "tok-b"],
    }


def _operator_cluster_rbac(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """ClusterRoles and their bindings other than the users' aggregated view/edit roles."""
    users = {"weightroll-view", "weightroll-edit"}
    return [
        o
        for o in objs
        if o["kind"] in ("ClusterRole", "ClusterRoleBinding") and o["metadata"]["name"] not in users
    ]


def test_weightupdates_are_aggregated_into_the_default_user_roles() -> None:
    """Issue 31 item 3: namespace users with Kubernetes' default view/edit/admin bindings read,
    create and steer WeightUpdates (the CLI's verbs patch the spec or the status subresource);
    the two ClusterRoles are bound to nobody and leave the operator's own RBAC as it was."""
    objs = objects(render())
    view = find(objs, "ClusterRole", "weightroll-view")
    edit = find(objs, "ClusterRole", "weightroll-edit")
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {
        k for k, v in view["metadata"]["labels"].items() if k.startswith(aggregate) and v == "true"
    } == {aggregate + "view", aggregate + "edit", aggregate + "admin"}
    assert {
        k for k, v in edit["metadata"]["labels"].items() if k.startswith(aggregate) and v == "true"
    } == {aggregate + "edit", aggregate + "admin"}
    assert _granted(view) == {
        ("weightroll.io", resource, verb)
        for resource in ("weightupdates", "weightupdates/status")
        for verb in ("get", "list", "watch")
    }
    assert _granted(edit) == {
        ("weightroll.io", "weightupdates", verb)
        for verb in ("create", "update", "patch", "delete", "deletecollection")
    } | {("weightroll.io", "weightupdates/status", "patch")}
    bound = {
        o["roleRef"]["name"] for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
    }
    assert not bound & {"weightroll-view", "weightroll-edit"}
    off = objects(render({"rbac": {"aggregateToDefaultRoles": False}}))
    assert not [o for o in off if o["kind"] == "ClusterRole"]


def test_rbac_and_serviceaccount_switches() -> None:
    objs = objects(render({"rbac": {"create": False}}))
    assert not {o["kind"] for o in objs} & {"Role", "RoleBinding"}
    assert not _operator_cluster_rbac(objs)
    objs = objects(render({"serviceAccount": {"create": False, "name": "existing-sa"}}))
    assert "ServiceAccount" not in {o["kind"] for o in objs}
    deploy = find(objs, "Deployment")
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "existing-sa"


def test_operator_deployment() -> None:
    deploy = find(objects(render()), "Deployment", "weightroll-operator")
    spec = deploy["spec"]
    assert spec["replicas"] == 2  # leader election: one acts, one stands by
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == OPERATOR_SERVICEACCOUNT
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (ctr,) = pod["containers"]
    assert ctr["command"] == ["weightroll-operator"]
    # the release namespace only (issue 28 item 7), INFO logging
    assert ctr["args"] == [f"--namespace={NAMESPACE}", "--leader-elect"]
    assert ctr["image"] == "ghcr.io/weightroll/weightroll-operator:0.1.0"
    ports = {p["name"]: p["containerPort"] for p in ctr["ports"]}
    assert ports == {"health": 8081, "metrics": 8080, "webhook": 9443}
    env = {e["name"]: e.get("value") for e in ctr["env"]}
    assert env["WEIGHTROLL_HEALTH_PORT"] == "8081"
    assert env["WEIGHTROLL_METRICS_PORT"] == "8080"
    assert env["WEIGHTROLL_LEASE_NAME"] == "weightroll-operator"
    config = OperatorConfig.from_env({k: v for k, v in env.items() if v is not None})
    assert (config.webhook_port, config.lease_seconds) == (9443, 15.0)
    for probe in ("livenessProbe", "readinessProbe"):
        assert ctr[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert ctr["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert ctr["resources"]["limits"] == {"memory": "512Mi"}
    sc = ctr["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in ctr["volumeMounts"]


def test_image_digest_args_and_probe_switch() -> None:
    digest = "sha256:" + "a" * 64
    values = {
        "image": {"digest": digest},
        "operator": {
            "livenessProbe": {"enabled": False},
            "verbose": True,
            "watchNamespaces": ["ml", "ml-canary"],
            "extraArgs": ["--interval=2"],
        },
    }
    deploy = find(objects(render(values)), "Deployment")
    ctr = deploy["spec"]["template"]["spec"]["containers"][0]
    assert ctr["image"] == f"ghcr.io/weightroll/weightroll-operator@{digest}"
    assert ctr["args"] == [
        "--verbose",
        "--namespace=ml",
        "--namespace=ml-canary",
        "--leader-elect",
        "--interval=2",
    ]
    assert "livenessProbe" not in ctr and "readinessProbe" in ctr


def test_more_replicas_need_leader_election() -> None:
    values = {"operator": {"replicas": 2, "leaderElection": {"enabled": False, "leaseSeconds": 15}}}
    with pytest.raises(helm_python.HelmRenderError, match="leaderElection"):
        render(values)
    single = {"operator": {"replicas": 1, "leaderElection": {"enabled": False, "leaseSeconds": 15}}}
    objs = objects(render(single))
    deploy = find(objs, "Deployment")
    assert deploy["spec"]["strategy"] == {"type": "Recreate"}
    assert not [o for o in objs if o["metadata"]["name"] == "weightroll-leader-election"]


def test_leader_election_role_is_one_lease() -> None:
    objs = objects(render())
    role = find(objs, "Role", "weightroll-leader-election")
    assert role["metadata"]["namespace"] == "weightroll-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["weightroll-operator"],
            "verbs": ["get", "update"],
        },
    ]
    binding = find(objs, "RoleBinding", "weightroll-leader-election")
    assert binding["roleRef"]["name"] == "weightroll-leader-election"


def test_pod_selector_reaches_the_operator() -> None:
    deploy = find(objects(render({"operator": {"podSelector": "app=vllm"}})), "Deployment")
    assert "--pod-selector=app=vllm" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_admission_webhook_is_served_and_registered() -> None:
    objs = objects(render())
    (config,) = [o for o in objs if o["kind"] == "ValidatingWebhookConfiguration"]
    (hook,) = config["webhooks"]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
    assert hook["rules"] == [
        {
            "apiGroups": ["weightroll.io"],
            "apiVersions": ["v1alpha1"],
            "resources": ["weightupdates"],
            "operations": ["CREATE", "UPDATE"],
            "scope": "Namespaced",
        }
    ]
    service = hook["clientConfig"]["service"]
    assert service == {
        "name": "weightroll-webhook",
        "namespace": "weightroll-system",
        "path": "/validate",
        "port": 443,
    }
    secret = find(objs, "Secret", "weightroll-webhook-tls")
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    svc = find(objs, "Service", "weightroll-webhook")
    assert svc["spec"]["ports"][0]["targetPort"] == "webhook"
    deploy = find(objs, "Deployment")
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["webhook-cert"]["secret"]["secretName"] == "weightroll-webhook-tls"
    given = objects(render({"webhook": {"existingSecret": "mine", "caBundle": "Q0E="}}))
    assert not [o for o in given if o["kind"] == "Secret" and "webhook" in o["metadata"]["name"]]
    (hook,) = find(given, "ValidatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["caBundle"] == "Q0E="
    off = objects(render({"webhook": {"enabled": False}}))
    assert "ValidatingWebhookConfiguration" not in {o["kind"] for o in off}


@pytest.mark.parametrize("admit", [True, False])
def test_admission_switch_reaches_the_operator_config(admit: bool) -> None:
    deploy = find(objects(render({"operator": {"admitUnmanagedPods": admit}})), "Deployment")
    ctr = deploy["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in ctr["env"] if e["name"].startswith("WEIGHTROLL_")}
    assert env["WEIGHTROLL_ADMIT_UNMANAGED_PODS"] == str(admit).lower()
    assert OperatorConfig.from_env(env).admit_unmanaged_pods is admit


def test_metrics_service_and_servicemonitor() -> None:
    objs = objects(render())
    svc = find(objs, "Service", "weightroll-metrics")
    assert svc["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    deploy = find(objs, "Deployment")
    assert (
        svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    )
    assert "ServiceMonitor" not in {o["kind"] for o in objs}

    objs = objects(render(scenario_values("monitoring-values.yaml")))
    sm = find(objs, "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s"
    assert endpoint["metricRelabelings"][0]["action"] == "drop"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()

    with pytest.raises(helm_python.HelmRenderError, match=r"needs metrics\.enabled"):
        render({"serviceMonitor": {"enabled": True}, "metrics": {"enabled": False}})


def _rules(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    pr = find(objects(render(values)), "PrometheusRule")
    (group,) = pr["spec"]["groups"]
    return {r["alert"]: r for r in group["rules"]}


def test_every_alert_is_documented() -> None:
    rules = _rules({"prometheusRule": {"enabled": True}})
    assert set(rules) == set(ALERTS)
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}
        assert rule["for"]
        ann = rule["annotations"]
        assert ann["summary"] and ann["description"]
        assert ann["runbook_url"].endswith(f"/docs/runbooks/{name}.md")
        runbook = REPO / "docs" / "runbooks" / f"{name}.md"
        text = runbook.read_text()
        for section in ("## Meaning", "## Impact", "## Diagnose", "## Fix"):
            assert section in text, f"{runbook} lacks {section}"


def test_alert_metric_names_follow_the_contract() -> None:
    """Every metric an alert reads is listed in docs/contracts.md."""
    contracts = (REPO / "docs" / "contracts.md").read_text()
    rules = _rules({"prometheusRule": {"enabled": True}})
    for rule in rules.values():
        for metric in set(re.findall(r"\bweightroll_[a-z_]+", rule["expr"])):
            assert f"`{metric}" in contracts, f"{rule['alert']} reads {metric}, not in contracts"


def test_alerts_can_be_disabled_and_overridden() -> None:
    values = scenario_values("monitoring-values.yaml")
    values["prometheusRule"]["disabled"] = {"WeightrollAgentUnreachable": True}
    rules = _rules(values)
    assert set(rules) == set(ALERTS) - {"WeightrollAgentUnreachable"}
    assert rules["WeightrollFleetStale"]["for"] == "45m"
    assert rules["WeightrollFleetStale"]["labels"]["severity"] == "info"
    assert rules["WeightrollFleetStale"]["labels"]["team"] == "ml-platform"
    assert "for more than 45m" in rules["WeightrollFleetStale"]["annotations"]["description"]
    assert rules["WeightrollReplicaLeftDrained"]["expr"].endswith("> 600")
    for rule in rules.values():
        # WeightrollOperatorDown reads `up` of the operator's job; the others our own metrics
        selectors = re.findall(r"(?:\bweightroll_[a-z_]+|\bup)(\{[^}]*\})?", rule["expr"])
        # Agent metrics come from the workload pods, under their own selector.
        sidecar = rule["alert"] in (
            "WeightrollTrainerPushFailed",
            "WeightrollReplicaBehindFleet",
            "WeightrollReplicaWeightsChanged",
        )
        job = "vllm-weightroll-agent" if sidecar else "weightroll-metrics"
        assert selectors and all(f'job="{job}"' in s for s in selectors), rule["expr"]
    all_off = {"prometheusRule": {"enabled": True, "disabled": dict.fromkeys(ALERTS, True)}}
    pr = find(objects(render(all_off)), "PrometheusRule")
    assert pr["spec"]["groups"][0]["rules"] is None or pr["spec"]["groups"][0]["rules"] == []


def test_crds_installed_and_kept() -> None:
    needs_crd()
    generated = yaml.safe_load(CRD_FILE.read_text())
    crd = find(objects(render()), "CustomResourceDefinition", "weightupdates.weightroll.io")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["spec"] == generated["spec"]
    crd = find(objects(render({"keepCRDs": False})), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in (crd["metadata"].get("annotations") or {})
    kinds = {o["kind"] for o in objects(render({"installCRDs": False}))}
    assert "CustomResourceDefinition" not in kinds


def test_missing_generated_crd_fails_with_a_clear_message(tmp_path: Path) -> None:
    chart_copy = tmp_path / "weightroll"
    shutil.copytree(CHART, chart_copy)
    (chart_copy / "files" / "crds" / CRD_FILE.name).unlink(missing_ok=True)
    chart = helm_python.Chart.load(str(chart_copy))
    try:
        with pytest.raises(helm_python.HelmRenderError, match="crdgen"):
            chart.render({"installCRDs": True}, name="weightroll", namespace="x")
    finally:
        chart.close()


def test_workload_example_is_prepared_for_weightroll() -> None:
    objs = objects(render(scenario_values("workload-values.yaml")))
    secret = find(objs, "Secret", "vllm-example-weightroll-token")
    assert set(secret["data"]) == {"token"}
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    assert pod["readinessGates"] == [{"conditionType": "weightroll.io/weights-ready"}]
    ctrs = {c["name"]: c for c in pod["containers"]}
    vllm, agent = ctrs["vllm"], ctrs["weightroll-agent"]
    assert "--worker-extension-cls=engine_agent.vllm_extension.WeightRollExtension" in vllm["args"]
    assert "--host=127.0.0.1" in vllm["args"] and "--port=8000" in vllm["args"]
    assert "--max-model-len=2048" in vllm["args"]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in vllm["env"]
    assert agent["command"] == ["weightroll-agent"]
    assert agent["args"][:2] == [
        "--vllm-url=http://127.0.0.1:8000",
        "--token-file=/var/run/weightroll/token",
    ]
    assert agent["ports"] == [{"name": "weightroll", "containerPort": 8470}]
    # TLS on the agent port by default (issue 28 item 8)
    assert agent["readinessProbe"]["httpGet"] == {
        "path": "/readyz",
        "port": "weightroll",
        "scheme": "HTTPS",
    }
    assert "--state-dir=/var/lib/weightroll" in agent["args"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    assert mounts["weightroll-token"]["readOnly"] is True
    token = volumes["weightroll-token"]["secret"]
    assert token["secretName"] == secret["metadata"]["name"]
    assert token["items"] == [{"key": "token", "path": "token"}]
    assert volumes["weightroll-state"] == {"name": "weightroll-state", "emptyDir": {}}
    assert mounts["weightroll-state"]["mountPath"] == "/var/lib/weightroll"
    # vLLM and the agent see the checkpoints at the same path.
    (vllm_models,) = vllm["volumeMounts"]
    assert (
        vllm_models
        == mounts["models"]
        == {
            "name": "models",
            "mountPath": "/models",
            "readOnly": True,
        }
    )
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "vllm-models"
    assert pod["automountServiceAccountToken"] is False
    role = find(objs, "Role", "weightroll-operator")
    (secrets,) = [r for r in role["rules"] if r["resources"] == ["secrets"]]
    assert secrets["resourceNames"] == [secret["metadata"]["name"]]


def _agent_env(values: dict[str, Any]) -> dict[str, str]:
    objs = objects(render(values))
    pod = find(objs, "Deployment", "vllm-example")["spec"]["template"]["spec"]
    (agent,) = [c for c in pod["containers"] if c["name"] == "weightroll-agent"]
    return {e["name"]: e.get("value", "") for e in agent["env"]}


def test_workload_example_names_its_boot_weights() -> None:
    """Issue 27 item 10: without --initial-source a rollback could only mark pods Failed."""
    values = scenario_values("workload-values.yaml")
    env = _agent_env(values)
    model = values.get("workloadExample", {}).get("vllm", {}).get("model", "/models/current")
    assert env["WEIGHTROLL_AGENT_INITIAL_VERSION"] == "v1"
    assert env["WEIGHTROLL_AGENT_INITIAL_SOURCE"] == model
    assert "WEIGHTROLL_AGENT_INITIAL_MANIFEST" not in env
    values["workloadExample"]["initialWeights"] = {
        "version": "base-7",
        "source": "/models/base-7",
        "manifest": "/models/base-7/weightroll-manifest.json",
    }
    env = _agent_env(values)
    assert env["WEIGHTROLL_AGENT_INITIAL_VERSION"] == "base-7"
    assert env["WEIGHTROLL_AGENT_INITIAL_SOURCE"] == "/models/base-7"
    assert env["WEIGHTROLL_AGENT_INITIAL_MANIFEST"] == "/models/base-7/weightroll-manifest.json"
    # A model named by hub id is no path to restore from: no source, the version still named.
    values["workloadExample"]["initialWeights"] = {"version": "v1", "source": ""}
    values["workloadExample"].setdefault("vllm", {})["model"] = "org/model"
    env = _agent_env(values)
    assert "WEIGHTROLL_AGENT_INITIAL_SOURCE" not in env
    assert env["WEIGHTROLL_AGENT_INITIAL_VERSION"] == "v1"


def test_notes_explain_workload_preparation() -> None:
    notes = render()["weightroll/templates/NOTES.txt"]
    for needle in (
        "weightroll.io/weights-ready",
        "--worker-extension-cls=engine_agent.vllm_extension.WeightRollExtension",
        "VLLM_SERVER_DEV_MODE=1",
        "/readyz",
        "8470",
    ):
        assert needle in notes


def test_readme_is_generated_from_values() -> None:
    """README.md matches README.md.gotmpl and values.yaml (tests/charts/chart_readme.py)."""
    from tests.charts.chart_readme import generate, values_rows

    assert (CHART / "README.md").read_text() == generate(), (
        "run: python tests/charts/chart_readme.py --write"
    )
    assert all(desc for _, _, _, desc in values_rows())


#: Keys a structural schema forbids inside anyOf/allOf/oneOf/not (Kubernetes "Specifying a
#: structural schema"); the apiserver rejects such a CRD with "must be empty to be structural".
_JUNCTOR_FORBIDDEN = {"type", "description", "default", "nullable", "additionalProperties"}


def _structural_problems(node: Any, path: str, in_junctor: bool = False) -> list[str]:
    problems: list[str] = []
    if isinstance(node, dict):
        if in_junctor:
            problems += [
                f"{path}.{k}"
                for k in node
                if k in _JUNCTOR_FORBIDDEN or k.startswith("x-kubernetes-")
            ]
        for key, value in node.items():
            if key in ("anyOf", "allOf", "oneOf"):
                for i, branch in enumerate(value):
                    problems += _structural_problems(branch, f"{path}.{key}[{i}]", True)
            elif key == "not":
                problems += _structural_problems(value, f"{path}.not", True)
            elif key in ("properties", "patternProperties"):
                for name, sub in value.items():
                    problems += _structural_problems(sub, f"{path}.{key}[{name}]", in_junctor)
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                problems += _structural_problems(value, f"{path}.{key}", in_junctor)
    return problems


def test_crd_schema_is_structural() -> None:
    """Offline version of the apiserver's structural-schema check (fast feedback for crdgen)."""
    needs_crd()
    crd = yaml.safe_load(CRD_FILE.read_text())
    for version in crd["spec"]["versions"]:
        schema = version["schema"]["openAPIV3Schema"]
        problems = _structural_problems(schema, f"{version['name']}.openAPIV3Schema")
        assert problems == [], (
            "not structural (use x-kubernetes-int-or-string with plain minimum/pattern instead of "
            f"typed anyOf branches): {problems}"
        )


def test_artifacthub_changes_annotation_is_a_valid_change_list() -> None:
    """Artifact Hub parses ``artifacthub.io/changes`` as YAML: a list of {kind, description}."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    changes = yaml.safe_load(meta["annotations"]["artifacthub.io/changes"])
    kinds = {"added", "changed", "deprecated", "removed", "fixed", "security"}
    assert isinstance(changes, list) and changes
    for change in changes:
        assert set(change) == {"kind", "description"} and change["kind"] in kinds, change
        assert isinstance(change["description"], str) and change["description"], change
