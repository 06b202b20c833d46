"""Every example WeightUpdate parses with the model and passes the admission webhook (and so the
CRD's rules): an example the webhook refuses cannot be applied as documented."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from weightroll_operator.api.v1alpha1 import KIND, parse_spec
from weightroll_operator.webhook import validate

EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*/weightupdate.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_example_is_valid(path: Path) -> None:
    for doc in yaml.safe_load_all(path.read_text()):
        assert doc["kind"] == KIND
        parse_spec(doc["spec"])
        assert validate(doc, None) is None
