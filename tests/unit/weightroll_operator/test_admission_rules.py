"""Bad WeightUpdates are refused at the door (issue 11 finding 9): the webhook's rule and the
CRD's CEL rules (evaluated here with cel-python, as an API server >= 1.25 would) agree on every
case, and every refusal names the field."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import pytest
from weightroll_operator.api import crdgen
from weightroll_operator.webhook import review, validate

GOOD: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "llm"}},
    "version": "v2",
    "source": {"uri": "file:///models/v2"},
    "agent": {"tokenSecretRef": {"name": "token"}},
}


def _with(**changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(GOOD)
    spec.update(changes)
    return spec


#: (spec, old spec or None, the field the refusal names); None: accepted.
CASES: list[tuple[dict[str, Any], dict[str, Any] | None, str | None]] = [
    (GOOD, None, None),
    (_with(selector={}), None, "spec.selector"),
    (_with(selector={"matchLabels": {}, "matchExpressions": []}), None, "spec.selector"),
    (
        _with(selector={"matchExpressions": [{"key": "app", "operator": "In"}]}),
        None,
        "spec.selector.matchExpressions",
    ),
    (
        _with(selector={"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}),
        None,
        "spec.selector.matchExpressions",
    ),
    (_with(selector={"matchExpressions": [{"key": "a", "operator": "Exists"}]}), None, None),
    (_with(source={"uri": "/m", "mode": "sparse"}), None, "spec.source.baseVersion"),
    (_with(source={"uri": "/m", "mode": "sparse", "baseVersion": "v1"}), None, None),
    (_with(source={"uri": "/m", "baseVersion": "v1"}), None, "spec.source.baseVersion"),
    (
        _with(strategy={"progressDeadlineSeconds": 60}),
        None,
        "spec.strategy.progressDeadlineSeconds",
    ),
    # issue 27 item 12: a deadline equal to the unit timeout fails a slow unit by construction
    (
        _with(strategy={"updateTimeoutSeconds": 60, "progressDeadlineSeconds": 60}),
        None,
        "spec.strategy.progressDeadlineSeconds",
    ),
    (
        _with(strategy={"updateTimeoutSeconds": 60, "progressDeadlineSeconds": 61}),
        None,
        None,
    ),
    (_with(source={"uri": "/other"}), GOOD, "spec.source"),
    (_with(version="v3", source={"uri": "/other"}), GOOD, None),
    (_with(paused=True), GOOD, None),
]
#: Rules that only the webhook and the OpenAPI schema check (no CEL needed).
WEBHOOK_ONLY: list[tuple[dict[str, Any], str]] = [
    (_with(source={"uri": "s3://bucket/v2"}), "spec.source.uri"),
    (_with(agent={"tokenSecretRef": {"name": "t", "key": ""}}), "spec.agent.tokenSecretRef.key"),
    (_with(version="V2_1"), "spec.version"),
    # what the agent's wire protocol refuses was admitted, then refused by every pass
    (_with(source={"uri": "/w\u0000/x"}), "spec.source"),
    # issue 27 item 12: tolerated failures that would hold every maxUnavailable slot
    (_with(strategy={"maxFailedReplicas": 1}), "spec.strategy.maxFailedReplicas"),
    (_with(strategy={"maxUnavailable": 2, "maxFailedReplicas": 3}), "spec.strategy.maxFailed"),
]


def _cel_failures(spec: dict[str, Any], old: dict[str, Any] | None) -> list[str]:
    """Messages of every CEL rule of the CRD that ``spec`` breaks (``old``: for transitions)."""
    env = celpy.Environment()
    failures = []
    for path, rules in crdgen.CEL_RULES.items():
        targets: list[tuple[Any, Any]] = [(spec, old)]
        for part in filter(None, path.split(".")):
            name = part.removesuffix("[]")
            targets = [
                (t.get(name), None if o is None else o.get(name))
                for t, o in targets
                if isinstance(t, dict) and name in t
            ]
            if part.endswith("[]"):
                targets = [(item, None) for t, _ in targets for item in t or []]
        for rule in rules:
            program = env.program(env.compile(rule["rule"]))
            for value, old_value in targets:
                if "oldSelf" in rule["rule"] and old_value is None:
                    continue  # transition rules apply to updates only
                activation = {"self": celpy.json_to_cel(value)}
                if old_value is not None:
                    activation["oldSelf"] = celpy.json_to_cel(old_value)
                if not bool(program.evaluate(activation)):
                    failures.append(rule["message"])
    return failures


@pytest.mark.parametrize(("spec", "old", "field"), CASES)
def test_webhook_and_cel_rules_agree(
    spec: dict[str, Any], old: dict[str, Any] | None, field: str | None
) -> None:
    problem = validate({"spec": spec}, None if old is None else {"spec": old})
    cel = _cel_failures(spec, old)
    if field is None:
        assert problem is None and cel == []
    else:
        assert problem is not None and problem.startswith(field), problem
        assert cel and all(m.startswith(field) for m in cel), cel


@pytest.mark.parametrize(("spec", "field"), WEBHOOK_ONLY)
def test_rules_the_schema_and_webhook_check(spec: dict[str, Any], field: str) -> None:
    problem = validate({"spec": spec}, None)
    assert problem is not None and problem.startswith(field), problem


@pytest.mark.parametrize(
    "strategy",
    [
        {"maxUnavailable": 2, "maxFailedReplicas": 1},
        {"maxUnavailable": "50%", "maxFailedReplicas": 3},
    ],
)
def test_tolerated_failures_below_the_budget_are_admitted(strategy: dict[str, Any]) -> None:
    """A percentage resolves against the fleet's size, unknown here: the rollout judges it."""
    assert validate({"spec": _with(strategy=strategy)}, None) is None


def test_refusals_of_specs_that_fail_by_construction_name_the_fix() -> None:
    deadline = validate(
        {"spec": _with(strategy={"updateTimeoutSeconds": 60, "progressDeadlineSeconds": 60})}, None
    )
    assert deadline is not None and "above 60" in deadline
    budget = validate({"spec": _with(strategy={"maxFailedReplicas": 1})}, None)
    assert budget is not None and "maxUnavailable" in budget and "at most 0" in budget


def test_an_unchanged_invalid_spec_may_still_be_updated() -> None:
    """An object stored before the webhook (or a rule) existed can still lose its finalizer."""
    stored = {"spec": _with(selector={}), "metadata": {"finalizers": ["weightroll.io/finalizer"]}}
    released = {"spec": _with(selector={}), "metadata": {"finalizers": []}}
    assert validate(released, stored) is None
    assert validate(stored, None) is not None


def test_review_answers_an_admission_review() -> None:
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "operation": "CREATE", "object": {"spec": _with(selector={})}},
    }
    answer = review(body)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == "u-1" and response["allowed"] is False
    assert response["status"]["message"].startswith("spec.selector must not be empty")
    body["request"]["operation"] = "DELETE"
    assert review(body)["response"]["allowed"] is True


def test_the_crd_without_cel_is_the_same_schema() -> None:
    with_cel, without = crdgen.build_crd(), crdgen.build_crd(cel=False)
    assert "x-kubernetes-validations" in str(with_cel)
    assert "x-kubernetes-validations" not in str(without)
