"""Issue 28 acceptance 2, the agent's side: generated requests against the real agent app.

Hypothesis writes requests to the agent's HTTP surface — every route and generated paths (dot
segments, encodings, long names), with the token, a wrong one, none, or header injection, and
bodies from valid updates to junk, deep nesting, huge numbers and non-UTF-8 bytes. For each
answer: never a 500 (a 503 only from ``/readyz``, which says not ready); a ``/v1`` refusal is in
our error schema; the token never appears in an answer; a request without the token changes
nothing (no update accepted, no rank called); sources outside the model directory are refused
before any rank is asked.
"""

from __future__ import annotations

import asyncio
import json
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from engine_agent.protocol import ErrorBody
from tests.contract.agent.conftest import TOKEN, AgentHarness

pytestmark = pytest.mark.asyncio

ROUTES = [
    "/healthz",
    "/readyz",
    "/metrics",
    "/v1/state",
    "/v1/updates",
    "/v1/updates/u-1",
    "/v1/updates/u-1/abort",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/weight_info",
]
_SEGMENT = st.one_of(
    st.sampled_from(["..", ".", "%2e%2e", "%2F", "u-1", "v1", "updates", "%00", "a" * 300]),
    st.text(alphabet=string.ascii_letters + string.digits + "-._~%", min_size=1, max_size=20),
)


@st.composite
def paths(draw: st.DrawFn) -> str:
    base = draw(st.sampled_from(ROUTES))
    extra = draw(st.lists(_SEGMENT, max_size=3))
    return base if not extra else base.rstrip("/") + "/" + "/".join(extra)


def _deep(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


@st.composite
def bodies(draw: st.DrawFn) -> bytes | None:
    source = "@SOURCE@"  # the checkpoint directory, filled in by the test
    kind = draw(
        st.sampled_from(["none", "update", "json", "deep", "huge", "nan", "bytes", "escape"])
    )
    if kind == "none":
        return None
    if kind == "update":
        uri = draw(
            st.sampled_from([source, "/etc", f"{source}/../..", "file:///proc/self", "relative"])
        )
        body: dict[str, Any] = {
            "id": draw(st.sampled_from(["u-1", "u-2", "U 1", "../x", ""])),
            "version": draw(st.sampled_from(["v1", "v2", "v 2"])),
            "source": {"uri": uri},
        }
        if draw(st.booleans()):
            body["source"]["manifest"] = draw(
                st.sampled_from([f"{source}/manifest.json", "/etc/passwd"])
            )
        return json.dumps(body).encode()
    if kind == "json":
        value = draw(
            st.recursive(
                st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                lambda inner: (
                    st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=3)
                ),
                max_leaves=10,
            )
        )
        return json.dumps(value).encode()
    if kind == "deep":
        return _deep(draw(st.integers(500, 100_000)))
    if kind == "huge":
        return b'{"id": ' + b"9" * draw(st.integers(4000, 50_000)) + b"}"
    if kind == "nan":
        return b'{"version": NaN, "x": Infinity}'
    if kind == "escape":
        return b'{"id": "\\ud800\\udfff\\u0000"}'
    return draw(st.binary(max_size=200))


def _writes(harness: AgentHarness) -> int:
    """Rank calls that change something (the agent's own watch loop asks state all along)."""
    return sum(
        1 for rank in harness.fake.ranks for name, _ in rank.calls if name != "weightroll_state"
    )


async def _idle(harness: AgentHarness) -> None:
    for _ in range(200):
        response = await harness.get("/v1/state")
        if (await response.json()).get("activeUpdateId") is None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("an update never finished")


def _headers(draw_auth: str) -> dict[str, str]:
    return {
        "token": {"Authorization": f"Bearer {TOKEN}"},
        "wrong": {"Authorization": "Bearer not-the-token"},
        "none": {},
        "basic": {"Authorization": f"Basic {TOKEN}"},
        "prefix": {"Authorization": f"Bearer {TOKEN[:-1]}"},
    }[draw_auth]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=paths(),
    auth=st.sampled_from(["token", "wrong", "none", "basic", "prefix"]),
    body=bodies(),
    content_type=st.sampled_from(
        ["application/json", "text/plain", "", "application/json; charset=latin-1"]
    ),
)
async def test_generated_requests_get_schema_answers_and_leak_nothing(
    harness: AgentHarness,
    checkpoints: dict[str, Path],
    method: str,
    path: str,
    auth: str,
    body: bytes | None,
    content_type: str,
) -> None:
    body = body.replace(b"@SOURCE@", str(checkpoints["v1"]).encode()) if body else body
    headers = _headers(auth)
    if content_type:
        headers["Content-Type"] = content_type
    if auth != "token":
        await _idle(harness)  # an update an earlier example started must not count here
    calls_before = _writes(harness)
    url = URL(harness.url + path, encoded=True)
    async with harness.http.request(method, url, data=body, headers=headers) as resp:
        raw = await resp.read()
        status = resp.status
        answer_headers = "\n".join(f"{k}: {v}" for k, v in resp.headers.items())
    text = raw.decode("utf-8", "replace")
    assert status != 500 and (status < 500 or path == "/readyz"), (status, path, text[:300])
    assert TOKEN not in text and TOKEN not in answer_headers, (path, text[:300])
    if status >= 400 and path.startswith("/v1") and status != 405:
        error = json.loads(raw)
        ErrorBody.model_validate(error.get("error", error))
    if auth != "token" and path not in ("/healthz", "/readyz", "/metrics"):
        assert status in (401, 404, 405), (status, path)
        assert _writes(harness) == calls_before, "a request without the token reached the ranks"
