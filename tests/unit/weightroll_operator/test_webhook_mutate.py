"""The pod-injection webhook (``POST /mutate``): AdmissionReview in, JSON Patch or refusal out.

The review function is tested directly; one test runs :class:`WebhookServer` over HTTPS (a
throwaway self-signed certificate) to check the route and the wire format the API server reads.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from weightroll_operator.domain.injection import INJECT_LABEL, InjectionSettings
from weightroll_operator.settings import OperatorConfig
from weightroll_operator.webhook import NOT_CONFIGURED, WebhookServer, mutate_review

from tests.harness.jsonpatch import apply_patch

SETTINGS = InjectionSettings(agent_image="agent:1", token_secret="tok")


def _review(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "operation": operation, "namespace": "ns", "object": pod},
    }


def _pod(labelled: bool = True, volume: bool = True) -> dict[str, Any]:
    mounts = [{"name": "models", "mountPath": "/models"}] if volume else []
    return {
        "metadata": {"generateName": "llm-", "labels": {INJECT_LABEL: "true"} if labelled else {}},
        "spec": {
            "containers": [{"name": "vllm", "image": "v", "volumeMounts": mounts}],
            "volumes": [{"name": "models", "emptyDir": {}}],
        },
    }


def _patch(answer: dict[str, Any]) -> list[dict[str, Any]]:
    response = answer["response"]
    assert response["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return ops


def test_labelled_pod_gets_a_patch_and_an_injected_one_none() -> None:
    answer = mutate_review(_review(_pod()), SETTINGS)
    assert answer["kind"] == "AdmissionReview" and answer["apiVersion"] == "admission.k8s.io/v1"
    assert answer["response"]["uid"] == "u-1" and answer["response"]["allowed"] is True
    injected = apply_patch(_pod(), _patch(answer))
    again = mutate_review(_review(injected), SETTINGS)["response"]
    assert again == {"uid": "u-1", "allowed": True}


def test_unlabelled_pod_and_other_operations_pass_untouched() -> None:
    assert mutate_review(_review(_pod(labelled=False)), SETTINGS)["response"] == {
        "uid": "u-1",
        "allowed": True,
    }
    for operation in ("UPDATE", "DELETE", "CONNECT"):
        response = mutate_review(_review(_pod(), operation), SETTINGS)["response"]
        assert response == {"uid": "u-1", "allowed": True}


def test_uncompletable_pod_is_refused_with_the_reason() -> None:
    response = mutate_review(_review(_pod(volume=False)), SETTINGS)["response"]
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    assert response["status"]["message"].startswith("no checkpoint volume")


def test_without_settings_a_labelled_pod_is_refused_and_others_pass() -> None:
    response = mutate_review(_review(_pod()), None)["response"]
    assert response["allowed"] is False and response["status"]["message"] == NOT_CONFIGURED
    assert mutate_review(_review(_pod(labelled=False)), None)["response"]["allowed"] is True


def test_v1beta1_reviews_are_answered_in_kind() -> None:
    review = _review(_pod()) | {"apiVersion": "admission.k8s.io/v1beta1"}
    assert mutate_review(review, SETTINGS)["apiVersion"] == "admission.k8s.io/v1beta1"


def test_settings_from_the_environment() -> None:
    assert OperatorConfig().injection() is None
    config = OperatorConfig.from_env(
        {
            "WEIGHTROLL_INJECT_AGENT_IMAGE": "agent:2",
            "WEIGHTROLL_INJECT_TOKEN_SECRET": "tok",
            "WEIGHTROLL_INJECT_TLS_SECRET": "tls",
            "WEIGHTROLL_INJECT_MODELS_VOLUME": "ckpt",
            "WEIGHTROLL_INJECT_AGENT_RESOURCES": '{"requests": {"cpu": "50m"}}',
            "WEIGHTROLL_AGENT_CA_FILE": "/ca.crt",
        }
    )
    assert config.injection() == InjectionSettings(
        agent_image="agent:2",
        token_secret="tok",
        tls=True,
        tls_secret="tls",
        models_volume="ckpt",
        agent_resources={"requests": {"cpu": "50m"}},
    )
    with pytest.raises(ValueError, match="WEIGHTROLL_INJECT_AGENT_RESOURCES='\\[\\]'"):
        OperatorConfig.from_env({"WEIGHTROLL_INJECT_AGENT_RESOURCES": "[]"})


@pytest.fixture
def cert_dir(tmp_path: Path) -> Path:
    command = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
               "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
               "-keyout", "tls.key", "-out", "tls.crt"]  # fmt: skip
    subprocess.run(command, cwd=tmp_path, check=True, capture_output=True)
    return tmp_path


@pytest.mark.asyncio
async def test_server_answers_mutate_over_https(cert_dir: Path) -> None:
    server = WebhookServer(0, cert_dir, host="127.0.0.1", injection=SETTINGS)
    await server.start()
    try:
        ctx = ssl.create_default_context(cafile=str(cert_dir / "tls.crt"))
        url = f"https://127.0.0.1:{server.bound_port}/mutate"
        async with aiohttp.ClientSession() as session:
            async with session.post(url, json=_review(_pod()), ssl=ctx) as resp:
                assert resp.status == 200
                answer = await resp.json()
            async with session.post(url, data=b"[]", ssl=ctx) as resp:
                assert resp.status == 400
        ops = _patch(answer)
        assert {"op": "add", "path": "/spec/readinessGates",
                "value": [{"conditionType": "weightroll.io/weights-ready"}]} in ops  # fmt: skip
    finally:
        await server.stop()
