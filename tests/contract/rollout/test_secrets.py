"""A missing or unreadable agent token Secret is reported (issue 11 finding 9), against kmock:
condition ``AgentTokenAvailable=False`` naming the Secret, the gauge behind the alert
WeightrollAgentTokenUnavailable, and nothing drained until the token can be read."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from weightroll_operator.api.v1alpha1 import SecretKeyRef
from weightroll_operator.credentials import SECRET_FORBIDDEN, token_problem
from weightroll_operator.errors import InvalidSpec, KubeError, WeightrollError

from tests.contract.rollout.harness import NS, Harness


def _gauge(h: Harness) -> dict[str, float]:
    return {
        s.labels["reason"]: s.value
        for m in h.metrics.registry.collect()
        if m.name == "weightroll_agent_token_unavailable"
        for s in m.samples
        if s.labels.get("name") == "wu"
    }


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("ref", "reason", "words"),
    [
        ({"name": "missing"}, "SecretNotFound", "Secret default/missing not found"),
        ({"name": "agent-token", "key": "other"}, "SecretKeyMissing", "has no key 'other'"),
    ],
)
async def test_unreadable_token_secret_is_reported_and_nothing_moves(
    h: Harness, ref: dict[str, str], reason: str, words: str
) -> None:
    await h.add_pods(2)
    await h.create_wu("wu", "v2", agent={"tokenSecretRef": ref})
    for _ in range(3):
        with pytest.raises(WeightrollError):
            await h.tick("wu")

    status = await h.status("wu")
    cond = h.condition(status, "AgentTokenAvailable")
    assert (cond["status"], cond["reason"]) == ("False", reason)
    assert cond["message"].startswith("spec.agent.tokenSecretRef: ") and words in cond["message"]
    assert words in status["message"]
    assert _gauge(h) == {reason: 1.0}
    assert h.emu.status_writes == [], "a pod was drained without a token"
    assert all(not a.executions for a in h.agents.agents.values())

    # The Secret appears (or gets the key): the next pass clears everything and rolls out.
    secret = {"name": ref["name"], "key": ref.get("key", "token")}
    path = f"/api/v1/namespaces/{NS}/secrets"
    data = {secret["key"]: base64.b64encode(b"s3cret").decode()}
    if ref["name"] == "agent-token":
        headers = {"Content-Type": "application/merge-patch+json"}
        async with h.http.patch(f"{path}/agent-token", json={"data": data}, headers=headers) as r:
            assert r.status < 400
    else:
        meta = {"name": ref["name"], "labels": {"weightroll.io/agent-token": "true"}}
        body = {"apiVersion": "v1", "kind": "Secret", "metadata": meta}
        async with h.http.post(path, json={**body, "data": data}) as r:
            assert r.status < 400
    h.rec.observer.token_ttl = 0.0
    await h.run_until(["wu"], h.phase_is("wu", "Succeeded"))
    status = await h.status("wu")
    assert "AgentTokenAvailable" not in {c["type"] for c in status["conditions"]}
    assert _gauge(h) == {}


def test_forbidden_secret_names_the_rbac_value() -> None:
    problem = token_problem(KubeError(403, "forbidden"), NS, SecretKeyRef(name="tok"))
    assert problem is not None and problem.reason == SECRET_FORBIDDEN
    assert "rbac.agentTokenSecretNames" in problem.message
    assert token_problem(KubeError(503, "unavailable"), NS, SecretKeyRef(name="tok")) is None


@pytest.mark.asyncio
async def test_a_secret_that_loses_its_opt_in_label_is_not_sent_from_the_next_pass(
    h: Harness, tmp_path: Path
) -> None:
    """Issue 28 item 8: removing ``weightroll.io/agent-token`` used to take up to the token
    cache's 60 s to take effect; the Secret is now read once per pass (the shipped default)."""
    agents = await h.add_pods(2)
    logs = [tmp_path / f"{a.pod}.log" for a in agents]
    for agent, log in zip(agents, logs, strict=True):
        agent.request_log = log
    await h.create_wu("wu", "v2")
    await h.tick("wu")
    assert any(log.exists() and log.read_text() for log in logs), "no agent was asked"

    headers = {"Content-Type": "application/merge-patch+json"}
    unlabel = {"metadata": {"labels": {"weightroll.io/agent-token": None}}}
    path = f"/api/v1/namespaces/{NS}/secrets/agent-token"
    async with h.http.patch(path, json=unlabel, headers=headers) as r:
        assert r.status < 400
    for log in logs:
        log.unlink(missing_ok=True)
    with pytest.raises(InvalidSpec, match=r"spec\.agent\.tokenSecretRef"):
        await h.tick("wu")
    assert not any(log.exists() for log in logs), "the token went to an agent after opt-out"
