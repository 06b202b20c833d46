"""docs/api.md stays true to the models: its field tables are what ``api_reference.py``
generates from the pydantic models, every field has a meaning, and no meaning outlives its
field. The agent route table matches the routes ``engine_agent.sidecar.app`` registers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from weightroll_operator.api.v1alpha1 import parse_spec

from tests.docs import api_reference as ref


def test_generated_tables_are_up_to_date() -> None:
    current = ref.API_MD.read_text()
    assert ref.render(current) == current, "run: python tests/docs/api_reference.py --write"


def test_every_spec_and_status_field_has_a_meaning() -> None:
    spec_paths = [row[0] for row in ref.spec_rows()]
    assert sorted(spec_paths) == sorted(ref.spec_meanings())
    status_fields = [row[0] for row in ref.status_rows()]
    assert sorted(status_fields) == sorted(ref.status_meanings())
    assert ref.UNDOCUMENTED not in ref.API_MD.read_text()


def _properties(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for key, sub in (node.get("properties") or {}).items():
        yield f"{path}.{key}", sub
        yield from _properties(sub, f"{path}.{key}")
        if isinstance(sub.get("items"), dict):
            yield from _properties(sub["items"], f"{path}.{key}[]")


@pytest.mark.parametrize("rel", ["crds", "charts/weightroll/files/crds"])
def test_every_crd_property_has_a_description(rel: str) -> None:
    """What ``kubectl explain weightupdate.<path>`` shows: a description for every field,
    the models' docstring (the same text as the docs/api.md table) and the printer columns."""
    crd = yaml.safe_load((ref.ROOT / rel / "weightupdates.weightroll.io.yaml").read_text())
    version = crd["spec"]["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    props = dict(_properties(root, ""))
    assert len(props) >= 65
    missing = sorted(path for path, node in props.items() if not node.get("description"))
    # `metadata` may carry nothing but its type (the API server refuses more and serves
    # ObjectMeta's documentation for it): tests/charts/test_chart_cluster.py installs the CRD.
    assert missing == [".metadata"]
    documented = ref.spec_meanings()
    for path, text in documented.items():
        assert props[f".spec.{path}"]["description"] == text, path
    for key, text in ref.status_meanings().items():
        assert props[f".status.{key}"]["description"] == text, key
    columns = [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [
        ("Phase", ".status.phase"),
        ("Version", ".spec.version"),
        ("Updated", ".status.replicas.updated"),
        ("Total", ".status.replicas.total"),
        ("Age", ".metadata.creationTimestamp"),
        ("Message", ".status.message"),
    ]


def test_every_wire_field_has_a_meaning() -> None:
    for name, (model, recurse) in ref.WIRE_MODELS.items():
        paths = [row[0] for row in ref.model_rows(model, recurse)]
        assert sorted(paths) == sorted(ref.WIRE_MEANINGS[name]), name


def _crd_leaves(node: dict[str, Any], prefix: str = "") -> set[str]:
    props = node.get("properties")
    if not props:
        return {prefix.rstrip(".")}
    leaves: set[str] = set()
    for key, sub in props.items():
        leaves |= _crd_leaves(sub, f"{prefix}{key}.")
    return leaves


def test_spec_table_covers_the_crd() -> None:
    crd = yaml.safe_load((ref.ROOT / "crds" / "weightupdates.weightroll.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    documented = {row[0] for row in ref.spec_rows()}
    for leaf in _crd_leaves(spec):
        # selector and tokenSecretRef are documented as one row each
        assert (
            leaf in documented
            or leaf.rsplit(".", 1)[0] in documented
            or any(leaf.startswith(f"{d}.") for d in documented)
        ), f"spec.{leaf} is not in docs/api.md"


def test_agent_route_table_matches_the_sidecar() -> None:
    from engine_agent.sidecar.app import create_app
    from engine_agent.sidecar.metrics import AgentMetrics

    class _Agent:
        """Only what create_app touches while registering routes."""

        metrics = AgentMetrics()

        class config:  # stands for AgentConfig
            trainer_token_file = None

    class _Tokens:
        pass

    app = create_app(_Agent(), _Tokens(), manage_agent=False)  # type: ignore[arg-type]
    routes = {
        f"{r.method} {r.resource.canonical}"
        for r in app.router.routes()
        if r.resource is not None and r.method not in ("HEAD", "*")
    }
    text = ref.API_MD.read_text()
    section = text[text.index("## Agent HTTP API") :]
    documented = set(re.findall(r"^\| `((?:GET|POST) /[^`]*)` \|", section, re.M))
    assert routes == documented


def test_quoted_invalid_spec_message_is_the_real_one() -> None:
    spec = {
        "selector": {"matchLabels": {"app": "x"}},
        "version": "v2",
        "source": {"uri": "/w", "mode": "sparse"},
    }
    with pytest.raises(ValueError) as err:
        parse_spec(spec)
    assert f"`{err.value}`" in ref.API_MD.read_text()


def test_every_status_view_field_is_described() -> None:
    rows = list(ref.view_rows())
    assert {"exitCode", "result", "current", "replicas.failed", "pods[].reason"} <= {
        path for path, _, _ in rows
    }
    assert all(text != "**undocumented**" for _, _, text in rows), rows
