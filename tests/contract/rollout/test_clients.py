"""The two I/O clients against real HTTP: the agent client against the simulated agent, the
Kubernetes client against kmock (request shapes: strategic merge on pods/status, only our
condition)."""

from __future__ import annotations

import base64

import pytest
from weightroll_operator.agent_client import AgentClient
from weightroll_operator.errors import (
    AgentConflict,
    AgentRejected,
    AgentUnauthorized,
    AgentUnavailable,
    InvalidSpec,
    KubeNotFound,
)
from weightroll_operator.ports import AgentTarget

from engine_agent.protocol import SourceSpec, UpdateRequest
from tests.contract.rollout.harness import NS, Harness
from tests.harness.fake_agent import FakeAgent, free_port

pytestmark = pytest.mark.asyncio


def _req(uid: str, version: str = "v2") -> UpdateRequest:
    return UpdateRequest(id=uid, version=version, source=SourceSpec(uri=f"/w/{version}"))


async def test_agent_client_status_codes() -> None:
    agent = FakeAgent(pod="p", host="127.0.0.1", port=free_port(), token="t", step=5)
    await agent.appear()
    client = AgentClient(timeout=1.0)
    good = AgentTarget("p", agent.base_url, "t")
    try:
        state = await client.state(good)
        assert (state.version, state.ready) == ("v1", True)
        with pytest.raises(AgentUnauthorized):
            await client.state(AgentTarget("p", agent.base_url, "wrong"))
        with pytest.raises(AgentUnauthorized):
            await client.state(AgentTarget("p", agent.base_url, None))
        assert await client.get_update(good, "nope") is None  # 404 -> unknown id
        await client.start_update(good, _req("u1"))
        await client.start_update(good, _req("u1"))  # idempotent by id
        assert agent.executions == ["u1"]
        with pytest.raises(AgentConflict):
            await client.start_update(good, _req("u2", "v3"))
        status = await client.get_update(good, "u1")
        assert status is not None and status.id == "u1"
        await client.abort_update(good, "u1")
        status = await client.get_update(good, "u1")
        assert status is not None and status.phase.value == "Aborted"
        with pytest.raises(AgentRejected) as err:
            await client._call(good, "POST", "/v1/updates", {"id": "x"})
        assert err.value.status == 422
        await agent.disappear()
        with pytest.raises(AgentUnavailable):
            await client.state(good)
    finally:
        await client.close()
        await agent.close()


async def test_pod_condition_is_a_strategic_merge_of_our_condition_only(h: Harness) -> None:
    await h.add_pods(1)
    await h.kube.patch_pod_condition(
        NS, "pod-0", {"type": "weightroll.io/weights-ready", "status": "False"}
    )
    patches = [r for r in h.emu if r.method == "PATCH" and r.subresource == "status"]
    assert len(patches) == 1
    req = patches[0]
    assert req.headers["Content-Type"] == "application/strategic-merge-patch+json"
    assert req.data == {
        "status": {"conditions": [{"type": "weightroll.io/weights-ready", "status": "False"}]}
    }
    conds = {c["type"]: c["status"] for c in (await h.pod("pod-0"))["status"]["conditions"]}
    assert conds == {"Ready": "False", "weightroll.io/weights-ready": "False"}
    with pytest.raises(ValueError, match=r"only weightroll\.io/weights-ready"):
        await h.kube.patch_pod_condition(NS, "pod-0", {"type": "Ready", "status": "True"})
    with pytest.raises(KubeNotFound):
        await h.kube.patch_pod_metadata(NS, "gone", annotations={"a": "b"})
    assert await h.kube.read_agent_token(NS, "agent-token", "token") == "s3cret"


async def test_agent_token_needs_the_opt_in_label_and_sends_the_first_line(h: Harness) -> None:
    """Issue 14 B/C: an unlabelled Secret is InvalidSpec naming the field; a rotating Secret
    (several lines) yields its first line, the token the operator sends."""
    await h.add_pods(1)  # also creates the labelled `agent-token`
    for name, labels, value in (
        ("plain", {}, b"s3cret"),
        ("rotating", {"weightroll.io/agent-token": "true"}, b"new-token\nold-token\n"),
    ):
        await h._post(
            f"/api/v1/namespaces/{NS}/secrets",
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": name, "namespace": NS, "labels": labels},
                "data": {"token": base64.b64encode(value).decode()},
            },
        )
    with pytest.raises(
        InvalidSpec, match=r"^spec\.agent\.tokenSecretRef: .*weightroll\.io/agent-token"
    ):
        await h.kube.read_agent_token(NS, "plain", "token")
    assert await h.kube.read_agent_token(NS, "rotating", "token") == "new-token"
