"""The admission rule (domain/admission.py): when a pod no WeightUpdate governs gets its gate."""

from __future__ import annotations

from typing import Any

import pytest
from weightroll_operator.domain.admission import (
    Admission,
    AdmissionReason,
    awaits_admission,
    decide,
)
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
)

GATE = CONDITION_WEIGHTS_READY
R = AdmissionReason


def pod(
    *,
    namespace: str = "ml",
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    readiness_gates: tuple[str, ...] = (GATE,),
    gate: str | None = None,
    containers_ready: str | None = "True",
    deleting: bool = False,
) -> dict[str, Any]:
    """A pod as the kubelet reports it; ``None`` leaves a condition out."""
    conditions = []
    if containers_ready is not None:
        conditions.append({"type": "ContainersReady", "status": containers_ready})
    if gate is not None:
        conditions.append({"type": GATE, "status": gate})
    meta: dict[str, Any] = {
        "name": "p0",
        "namespace": namespace,
        "labels": {"app": "llm"} if labels is None else labels,
        "annotations": annotations or {},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return {
        "metadata": meta,
        "spec": {"readinessGates": [{"conditionType": g} for g in readiness_gates]},
        "status": {"conditions": conditions},
    }


def wu(
    name: str = "wu",
    *,
    namespace: str = "ml",
    selector: dict[str, Any] | None = None,
    phase: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "selector": selector or {"matchLabels": {"app": "llm"}},
        "version": "v2",
        "source": {"uri": "/weights/v2"},
        **spec,
    }
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": body,
        "status": {"phase": phase} if phase else {},
    }


CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]], str]] = [
    # (case, pod, peers, reason)
    ("fresh pod, no WeightUpdate", pod(), [], R.ADMITTED),
    (
        "WeightUpdate selects other pods",
        pod(),
        [wu(selector={"matchLabels": {"app": "other"}})],
        R.ADMITTED,
    ),
    ("selecting WeightUpdate in another namespace", pod(), [wu(namespace="other")], R.ADMITTED),
    ("selecting WeightUpdate with an invalid spec", pod(), [wu(version="")], R.ADMITTED),
    ("selecting WeightUpdate without a spec", pod(), [{"metadata": wu()["metadata"]}], R.ADMITTED),
    (
        "NotIn selector excludes the pod",
        pod(labels={"app": "llm", "tier": "canary"}),
        [
            wu(
                selector={
                    "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["canary"]}]
                }
            )
        ],
        R.ADMITTED,
    ),
    ("other gates besides ours", pod(readiness_gates=("example.com/x", GATE)), [], R.ADMITTED),
    ("pod without our readiness gate", pod(readiness_gates=()), [], R.NO_READINESS_GATE),
    (
        "pod with another gate only",
        pod(readiness_gates=("example.com/x",)),
        [],
        R.NO_READINESS_GATE,
    ),
    ("gate True already", pod(gate="True"), [], R.GATE_TRUE),
    ("gate False: drained by a WeightUpdate", pod(gate="False"), [], R.GATE_FALSE),
    ("gate Unknown", pod(gate="Unknown"), [], R.GATE_FALSE),
    ("being deleted", pod(deleting=True), [], R.DELETING),
    ("owner annotation", pod(annotations={ANNOTATION_OWNER: "ml/wu"}), [], R.OWNED),
    ("empty owner annotation", pod(annotations={ANNOTATION_OWNER: ""}), [], R.OWNED),
    (
        "weight-state annotation",
        pod(annotations={ANNOTATION_WEIGHT_STATE: '{"state": "Verified"}'}),
        [],
        R.HAS_WEIGHT_STATE,
    ),
    (
        "weight-state unreadable",
        pod(annotations={ANNOTATION_WEIGHT_STATE: "?"}),
        [],
        R.HAS_WEIGHT_STATE,
    ),
    ("containers not ready", pod(containers_ready="False"), [], R.CONTAINERS_NOT_READY),
    ("no ContainersReady condition yet", pod(containers_ready=None), [], R.CONTAINERS_NOT_READY),
    ("selected by a WeightUpdate", pod(), [wu()], R.SELECTED),
    ("selected by a Succeeded WeightUpdate", pod(), [wu(phase="Succeeded")], R.SELECTED),
    ("selected by a Failed WeightUpdate", pod(), [wu(phase="Failed")], R.SELECTED),
    ("selected by a paused WeightUpdate", pod(), [wu(paused=True)], R.SELECTED),
    (
        "selected by one of several",
        pod(),
        [wu("a", version=""), wu("b", namespace="x"), wu("c")],
        R.SELECTED,
    ),
    # The model refuses an empty selector: invalid, so it selects nothing.
    ("empty selector is invalid", pod(), [wu(selector={"matchLabels": {}})], R.ADMITTED),
    # Order: the first condition that fails is the reason.
    ("drained and selected", pod(gate="False"), [wu()], R.GATE_FALSE),
    (
        "owned, not ready",
        pod(annotations={ANNOTATION_OWNER: "ml/wu"}, containers_ready="False"),
        [],
        R.OWNED,
    ),
    ("not ready and selected", pod(containers_ready="False"), [wu()], R.CONTAINERS_NOT_READY),
]


@pytest.mark.parametrize(
    ("the_pod", "peers", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_rule(the_pod: dict[str, Any], peers: list[dict[str, Any]], reason: str) -> None:
    decision = decide(the_pod, peers)
    assert decision.reason == reason
    assert decision.admit is (reason == R.ADMITTED)
    assert decision.message and not decision.message.endswith(".")


def test_admitted_message_and_selected_names_the_weightupdate() -> None:
    assert decide(pod(), []) == Admission(True, R.ADMITTED, "No WeightUpdate selects it")
    assert decide(pod(), [wu("llama")]).message == "Selected by WeightUpdate llama"


def test_inputs_are_not_modified() -> None:
    the_pod, peers = pod(), [wu(version="")]
    before = repr((the_pod, peers))
    decide(the_pod, iter(peers))
    assert repr((the_pod, peers)) == before


@pytest.mark.parametrize(
    ("the_pod", "expected"),
    [
        (pod(), True),
        (pod(containers_ready="False"), True),  # decide() checks the rest
        (pod(annotations={ANNOTATION_OWNER: "ml/wu"}), True),
        (pod(gate="True"), False),
        (pod(gate="False"), False),
        (pod(readiness_gates=()), False),
        ({}, False),
    ],
)
def test_prefilter(the_pod: dict[str, Any], expected: bool) -> None:
    assert awaits_admission(the_pod) is expected
