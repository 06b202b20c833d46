"""Issue 28 acceptance 2, the admission path: generated WeightUpdates, judged by what left.

Hypothesis writes WeightUpdate specs whose names, keys, versions and source URIs mix valid
values with traversals, encodings, control characters and junk fields. Each one goes through
the webhook (``review``: an answer, never an exception; a refusal names a ``spec.`` field and
stays bounded) and then — accepted or not, as an object stored before the webhook existed
would be — through a real reconcile pass against kmock and real HTTP agents. The oracle is the
requests kmock and the agents received: only paths of the WeightUpdate's namespace, the Secret
the spec names and nothing else, agents only at pods' addresses, and the token never in the
WeightUpdate's status.
"""

from __future__ import annotations

import contextlib
import itertools
import string
from typing import Any
from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from weightroll_operator.api.names import is_dns_subdomain
from weightroll_operator.errors import WeightrollError
from weightroll_operator.webhook import review

from tests.contract.rollout.harness import NS, Harness
from tests.harness.kube_fleet import make_weightupdate

pytestmark = pytest.mark.asyncio

_NAMES = st.one_of(
    st.sampled_from(
        [
            "agent-token",
            "../../kube-system/secrets/agent-token",
            "..",
            "agent-token/..",
            "%2e%2e%2fkube-system",
            "agent-token?x=1",
            "agent-token#frag",
            "agent-token\n",
            "AGENT-TOKEN",
            "a" * 254,
            "",
        ]
    ),
    st.text(alphabet=string.ascii_lowercase + "-./%?#\\:@ \n", min_size=1, max_size=40),
)
_URIS = st.one_of(
    st.sampled_from(["/weights/v2", "file:///weights/v2", "http://169.254.169.254/", "../x"]),
    st.text(alphabet=string.printable, min_size=1, max_size=40),
)
_counter = itertools.count()
WU_API = "weightroll.io/v1alpha1"


@st.composite
def specs(draw: st.DrawFn) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": draw(_NAMES)}
    if draw(st.booleans()):
        ref["key"] = draw(st.sampled_from(["token", "..", "../token", "tok/en", "t\n", "k"]))
    source: dict[str, Any] = {"uri": draw(_URIS)}
    if draw(st.booleans()):
        source["manifest"] = draw(_URIS)
    spec: dict[str, Any] = {
        "version": draw(st.sampled_from(["v2", "V2", "v2/../v3", "v2\n", "v" * 70])),
        "source": source,
        "agent": {"tokenSecretRef": ref},
    }
    if draw(st.booleans()):
        spec["agent"]["port"] = draw(st.sampled_from([1, 8001, 65535, 0, 70000]))
    if draw(st.booleans()):
        spec[draw(st.sampled_from(["junk", "status", "selector"]))] = draw(
            st.sampled_from([{}, [], "x", {"matchLabels": {"app": "llm/../x"}}])
        )
    return spec


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=specs())
async def test_generated_weightupdates_reach_only_what_they_name(
    h: Harness, spec: dict[str, Any]
) -> None:
    if not h.agents.agents:
        await h.add_pods(2)  # one Secret "agent-token" (token s3cret) and two real agents
    name = f"wu-{next(_counter)}"
    version = spec["version"]
    rest = {k: v for k, v in spec.items() if k != "version"}
    body = make_weightupdate(name, version, **rest)

    answer = review({"request": {"uid": "1", "operation": "CREATE", "object": body}})
    response = answer["response"]
    if not response["allowed"]:
        message = response["status"]["message"]
        assert message.startswith("spec.") or "spec." in message, message
        assert len(message) < 4000

    paths: list[str] = []
    handle = h.emu._handle

    async def recording(request: Any) -> Any:
        paths.append(str(request.url.path) if hasattr(request, "url") else "")
        return await handle(request)

    h.emu._handle = recording
    try:
        await h.create_wu(name, version, **rest)
        paths.clear()
        with contextlib.suppress(WeightrollError):  # refused: what matters is what was sent
            await h.tick(name)
    finally:
        h.emu._handle = handle

    assert paths, "the pass made no request (the recorder saw nothing)"
    ref = spec["agent"]["tokenSecretRef"]
    allowed_secret = f"/api/v1/namespaces/{NS}/secrets/{ref['name']}"
    for path in paths:
        decoded = unquote(path)
        assert decoded.startswith((f"/api/v1/namespaces/{NS}/", f"/apis/{WU_API}/namespaces/{NS}/"))
        assert "/../" not in decoded and not decoded.endswith("/.."), path
        if "/secrets" in decoded:
            assert is_dns_subdomain(ref["name"]), f"a Secret was read for a non-name: {path}"
            assert decoded == allowed_secret, path
    status = await h.status(name)
    assert "s3cret" not in str(status)
