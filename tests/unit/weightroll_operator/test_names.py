"""Issue 28 item 1: a name the operator puts into a URL path is a Kubernetes name, one segment.

Table cases for the grammar, generated names for the property (whatever the input, either no
request is made or exactly one path segment that is the name itself), and the three edges that
check a WeightUpdate's Secret reference: the model (so the webhook), the CRD schema, the client.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from weightroll_operator.api.crdgen import build_crd
from weightroll_operator.api.names import (
    agent_address,
    check_secret_key,
    is_dns_label,
    is_dns_subdomain,
    path_segment,
)
from weightroll_operator.api.v1alpha1 import SecretKeyRef
from weightroll_operator.webhook import validate

TRAVERSAL = "../../team-b/secrets/agent-token"


def wu_body(**spec: Any) -> dict[str, Any]:
    """A WeightUpdate that is valid but for what ``spec`` changes."""
    base = {
        "selector": {"matchLabels": {"app": "llm"}},
        "version": "v2",
        "source": {"uri": "file:///models/v2"},
    }
    return {"metadata": {"name": "wu"}, "spec": {**base, **spec}}


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("agent-token", True),
        ("a", True),
        ("a.b-c.d", True),
        ("a" * 253, True),
        ("a" * 254, False),
        ("", False),
        (TRAVERSAL, False),
        ("..", False),
        (".", False),
        ("a/b", False),
        ("a%2fb", False),
        ("%2e%2e", False),
        ("A", False),
        ("-a", False),
        ("a-", False),
        ("a..b", False),
        ("a\x00", False),
        ("a\n", False),  # Python's $ matches before a final newline; the API's does not
        ("a?b", False),
        ("a#b", False),
        ("\uff53ecret", False),  # full-width letter: not ASCII
    ],
)
def test_object_names_follow_the_api_grammar(name: str, ok: bool) -> None:
    assert is_dns_subdomain(name) is ok
    if ok:
        assert path_segment(name) == name
    else:
        with pytest.raises(ValueError, match="not a Kubernetes object name"):
            path_segment(name)


def test_namespaces_are_labels() -> None:
    assert is_dns_label("team-a") and not is_dns_label("team.a") and not is_dns_label("a" * 64)
    with pytest.raises(ValueError, match="namespace name"):
        path_segment("team-a/../team-b", namespace=True)


@pytest.mark.parametrize("key", [".", "..", "..data", "a/b", "", "a b", "k" * 254])
def test_secret_keys_refuse_paths(key: str) -> None:
    with pytest.raises(ValueError, match="Secret data key"):
        check_secret_key(key)


@settings(max_examples=2000, deadline=None)
@given(st.text(min_size=0, max_size=300))
def test_any_text_is_one_segment_or_no_request(text: str) -> None:
    try:
        segment = path_segment(text)
    except ValueError:
        return
    assert segment == text, "a valid name needed quoting"
    assert "/" not in segment and segment not in (".", "..") and "%" not in segment
    # the API's grammar, written independently: dot-separated labels of [a-z0-9-]
    labels = text.split(".")
    assert len(text) <= 253
    assert all(re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", label) for label in labels)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from("abz09-./%\\?#:@ \x00"), min_size=1, max_size=40))
def test_generated_secret_refs_are_refused_at_the_webhook_unless_names(name: str) -> None:
    body: dict[str, Any] = wu_body(agent={"tokenSecretRef": {"name": name}})
    problem = validate(body, None)
    if is_dns_subdomain(name):
        assert problem is None
    else:
        assert problem is not None and "spec.agent.tokenSecretRef.name" in problem


def test_the_traversal_is_refused_by_model_webhook_and_crd() -> None:
    for name in (TRAVERSAL, "agent-token\n"):
        with pytest.raises(ValueError, match=r"name"):
            SecretKeyRef.model_validate({"name": name})
    problem = validate(wu_body(agent={"tokenSecretRef": {"name": TRAVERSAL}}), None)
    assert problem is not None and "spec.agent.tokenSecretRef.name" in problem
    ref = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["agent"]["properties"]["tokenSecretRef"]["properties"]
    assert not re.search(ref["name"]["pattern"], TRAVERSAL)
    assert ref["name"]["maxLength"] == 253
    assert not re.search(ref["key"]["pattern"], "a/b")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("10.1.2.3", True),
        ("127.0.0.1", True),
        ("fd00::1", True),
        ("169.254.169.254", False),  # cloud metadata
        ("fe80::1", False),
        ("0.0.0.0", False),
        ("::", False),
        ("224.0.0.1", False),
        ("::ffff:169.254.169.254", False),
        ("10.1.2.3/8", False),
        ("evil.example:80/x?", False),
        ("", False),
    ],
)
def test_pod_addresses_are_parsed(text: str, ok: bool) -> None:
    assert (agent_address(text) is not None) is ok


@pytest.mark.parametrize(
    "argv",
    [["status", "../x"], ["pause", "wu", "-n", "a/b"], ["abort", "a%2fb"], ["status", "x\n"]],
)
def test_the_cli_refuses_a_path_as_a_name(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from weightroll_operator.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "is not a" in capsys.readouterr().err
