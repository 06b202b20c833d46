"""The README's first screen (issue 13 I): what weightroll is in two sentences, a WeightUpdate
manifest that the CRD and the operator accept, the two commands — and only after those, the
failure modes it guards against.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from weightroll_operator.api import v1alpha1 as api

from tests.docs.test_examples import _assert_subset, _schema_errors

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _sections() -> list[str]:
    return re.findall(r"^## (.+)$", README, re.M)


def test_first_screen_is_what_a_manifest_and_the_two_commands() -> None:
    intro = README.split("```", 1)[0]
    assert intro.startswith("# weightroll\n")
    prose = " ".join(intro.split("\n", 1)[1].split())
    assert len(re.findall(r"[.;!?](?:\s|$)", prose.replace(";", ""))) == 2, prose
    sections = _sections()
    assert sections[0] == "The two commands", sections
    assert any(s.startswith("Why") for s in sections[1:3]), sections
    commands = README.split("## The two commands", 1)[1].split("```bash", 1)[1].split("```")[0]
    assert [line.split("#")[0].strip() for line in commands.strip().splitlines()] == [
        "make demo",
        "make test",
    ]


def test_first_manifest_is_a_valid_weightupdate() -> None:
    block = README.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert README.index("```yaml") < README.index("## The two commands")
    doc = yaml.safe_load(block)
    assert (doc["apiVersion"], doc["kind"]) == (api.API_VERSION, api.KIND)
    assert _schema_errors(doc) == []
    _assert_subset(doc["spec"], api.parse_spec(doc["spec"]).to_json_dict(), "spec")
