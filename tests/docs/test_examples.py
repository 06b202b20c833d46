"""``examples/NN-*/``: numbered, each with a README that names its manifest, and every manifest
valid twice over: against the generated CRD's OpenAPI schema (what ``kubectl apply`` checks;
``jsonschema`` as in tooling.md §4) and against the operator's pydantic parser (what the
operator enforces beyond the schema: unknown fields, cross-field rules).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from weightroll_operator.api import v1alpha1 as api

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EXAMPLE_DIRS = sorted(p for p in EXAMPLES.iterdir() if p.is_dir())
MANIFESTS = sorted(EXAMPLES.glob("*/*.yaml"))
#: The scenarios issue 6 asks for.
REQUIRED = ["01-basic", "02-canary-pause", "03-sparse-update", "04-lws-groups"]


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "weightupdates.weightroll.io.yaml").read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def _schema_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(_schema())
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def test_examples_are_numbered_and_complete() -> None:
    names = [p.name for p in EXAMPLE_DIRS]
    assert names[: len(REQUIRED)] == REQUIRED
    for i, name in enumerate(names, start=1):
        assert re.fullmatch(rf"{i:02d}-[a-z0-9-]+", name), f"examples/{name}: not numbered {i:02d}"


@pytest.mark.parametrize("directory", EXAMPLE_DIRS, ids=lambda p: p.name)
def test_readme_names_every_manifest(directory: Path) -> None:
    readme = directory / "README.md"
    assert readme.is_file(), f"{directory.name} has no README.md"
    text = readme.read_text()
    assert text.startswith(f"# {directory.name}:"), "the title starts with the directory name"
    # An example is a manifest to apply, or a script to run (05-trainer).
    manifests = sorted([*directory.glob("*.yaml"), *directory.glob("*.py")])
    assert manifests, f"{directory.name} has no manifest or script"
    for manifest in manifests:
        assert manifest.name in text, f"{readme.relative_to(ROOT)} does not mention {manifest.name}"
    # A command that applies an example names this example's own file.
    for path in re.findall(r"kubectl apply [^\n]*-f (\S+)", text):
        assert (ROOT / path).is_file(), f"{readme.relative_to(ROOT)}: {path} does not exist"
        assert Path(path).parent.name == directory.name


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_manifest_matches_crd_schema_and_parser(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs
    for doc in docs:
        assert (doc["apiVersion"], doc["kind"]) == (api.API_VERSION, api.KIND)
        assert _schema_errors(doc) == []
        spec = api.parse_spec(doc["spec"])
        # Every value the example writes survives parsing unchanged (nothing is coerced).
        _assert_subset(doc["spec"], spec.to_json_dict(), "spec")


def _assert_subset(part: Any, full: Any, where: str) -> None:
    if isinstance(part, dict):
        for key, value in part.items():
            assert key in full, f"{where}.{key} is dropped by the parser"
            _assert_subset(value, full[key], f"{where}.{key}")
    else:
        assert part == full, f"{where}: {part!r} parses as {full!r}"


def test_lws_example_groups_units() -> None:
    doc = yaml.safe_load((EXAMPLES / "04-lws-groups" / "weightupdate.yaml").read_text())
    assert api.parse_spec(doc["spec"]).group_by == "leaderworkerset.sigs.k8s.io/group-index"


def test_sparse_example_names_its_base() -> None:
    doc = yaml.safe_load((EXAMPLES / "03-sparse-update" / "weightupdate.yaml").read_text())
    spec = api.parse_spec(doc["spec"])
    assert (spec.source.mode, spec.source.base_version) == (api.SourceMode.SPARSE, "v3")


def test_canary_example_pauses() -> None:
    doc = yaml.safe_load((EXAMPLES / "02-canary-pause" / "weightupdate.yaml").read_text())
    strategy = api.parse_spec(doc["spec"]).strategy
    assert strategy.canary == 2 and strategy.pause_after_canary


# The two checks really check: broken variants of an example fail the one that should catch them.


def _basic() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "01-basic" / "weightupdate.yaml").read_text())
    return doc


def test_schema_catches_a_bad_percentage_and_a_bad_enum() -> None:
    doc = _basic()
    doc["spec"]["strategy"]["maxUnavailable"] = "150%"
    doc["spec"]["strategy"]["onFailure"] = "Retry"
    errors = _schema_errors(doc)
    assert any(e.startswith("spec.strategy.maxUnavailable") for e in errors), errors
    assert any(e.startswith("spec.strategy.onFailure") for e in errors), errors


def test_parser_catches_what_the_schema_cannot() -> None:
    doc = _basic()
    doc["spec"]["strategy"]["maxUnavialable"] = 2  # a typo: the structural schema would prune it
    doc["spec"]["source"]["mode"] = "sparse"  # without baseVersion
    with pytest.raises(ValueError) as err:
        api.parse_spec(doc["spec"])
    assert "spec.strategy.maxUnavialable: unknown field" in str(err.value)
