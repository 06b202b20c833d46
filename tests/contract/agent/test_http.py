"""Contract: authentication, input validation and the probe routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.contract.agent.conftest import AgentHarness, update_body

pytestmark = pytest.mark.asyncio

V1_ROUTES = [
    ("GET", "/v1/state"),
    ("POST", "/v1/updates"),
    ("GET", "/v1/updates/u-1"),
    ("POST", "/v1/updates/u-1/abort"),
    ("GET", "/v1/anything-else"),
]


@pytest.mark.parametrize(("method", "path"), V1_ROUTES)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic czNjcmV0LXRva2Vu"},
        {"Authorization": "s3cret-token"},
    ],
    ids=["none", "wrong", "empty", "basic", "no-scheme"],
)
async def test_v1_routes_need_the_bearer_token(
    harness: AgentHarness, method: str, path: str, headers: dict[str, str]
) -> None:
    response = await harness.http.request(method, harness.url + path, headers=headers, json={})
    assert response.status == 401
    body = await response.json()
    assert body["code"] == "unauthorized"
    assert "Bearer" in response.headers["WWW-Authenticate"]
    assert "s3cret" not in await response.text()


async def test_probes_and_metrics_need_no_token(harness: AgentHarness) -> None:
    assert (await harness.http.get(harness.url + "/healthz")).status == 200
    assert (await harness.http.get(harness.url + "/readyz")).status in (200, 503)
    assert (await harness.http.get(harness.url + "/metrics")).status == 200


async def test_token_rotation_takes_effect(harness: AgentHarness, token_file: Path) -> None:
    assert (await harness.get("/v1/state")).status == 200
    token_file.write_text("rotated-token-value\n")
    assert (await harness.get("/v1/state")).status == 401
    rotated = harness.headers("rotated-token-value")
    assert (await harness.get("/v1/state", headers=rotated)).status == 200


def _body(**changes: Any) -> dict[str, Any]:
    body = update_body("u-1", "v1", Path("/ckpt/v1"))
    body.update(changes)
    return body


@pytest.mark.parametrize(
    ("payload", "status", "field", "text"),
    [
        ("{not json", 400, None, "not valid JSON"),
        ("[1, 2]", 400, None, "JSON object"),
        ('"x"', 400, None, "JSON object"),
        (_body(colour="red"), 422, "colour", "Extra inputs"),
        (_body(version="not a version!"), 422, "version", "pattern"),
        (_body(version=""), 422, "version", "pattern"),
        (_body(id="UPPER_case"), 422, "id", "pattern"),
        (_body(source={"uri": "s3://bucket/ckpt"}), 422, "source", "file:// URI"),
        (_body(source={"uri": "relative/path"}), 422, "source", "absolute path"),
        (_body(source={"uri": "/ckpt", "manifest": "http://x/m.json"}), 422, "source", "manifest"),
        (_body(source={"uri": "/ckpt", "extra": 1}), 422, "source.extra", "Extra inputs"),
        (_body(mode="sparse"), 422, None, "baseVersion is required"),
        (_body(mode="partial"), 422, None, "scope"),
        (_body(mode="partial", scope=["lm_head."]), 422, None, "baseVersion is required"),
        (_body(mode="everything"), 422, "mode", "full"),
        (_body(drain={"mode": "later"}), 422, "drain.mode", "wait"),
        (_body(drain={"timeoutSeconds": -1}), 422, "drain.timeoutSeconds", "greater than"),
        ({"version": "v1", "source": {"uri": "/x"}}, 422, "id", "Field required"),
    ],
    ids=lambda value: None if isinstance(value, dict | str) else str(value),
)
async def test_bad_update_bodies_are_4xx_naming_the_problem(
    harness: AgentHarness, payload: Any, status: int, field: str | None, text: str
) -> None:
    data = payload if isinstance(payload, str) else None
    kwargs: dict[str, Any] = {"headers": harness.headers()}
    if data is None:
        kwargs["json"] = payload
    else:
        kwargs["data"] = data
        kwargs["headers"]["Content-Type"] = "application/json"
    response = await harness.http.post(harness.url + "/v1/updates", **kwargs)
    assert response.status == status, await response.text()
    body = await response.json()
    assert body["code"] in ("malformed_json", "invalid_request")
    assert text in body["message"]
    if field is not None:
        assert body["field"] == field
    assert harness.fake.calls("weightroll_begin") == 0


async def test_unknown_update_is_404(harness: AgentHarness) -> None:
    response = await harness.get("/v1/updates/nope")
    assert response.status == 404
    assert (await response.json())["field"] == "id"
