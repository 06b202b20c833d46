"""``spec.source.manifestDigest`` (issue 28 item 5): a WeightUpdate pins its manifest's bytes.

Before: the manifest was self-certified, so whoever could write the model volume could replace
checkpoint and manifest together and the unchanged WeightUpdate committed it. The pin is
validated at the door (model, webhook, CRD schema and CEL, every refusal naming the field),
carried on the wire to the agent, and counts as part of the source: a verdict loaded without
the pin (or with another) is no verdict for a spec that pins.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from weightroll_operator.api import crdgen
from weightroll_operator.api.v1alpha1 import parse_spec
from weightroll_operator.domain.actions import Claim
from weightroll_operator.domain.model import SourceRef, UnitState, WeightState
from weightroll_operator.domain.plan import PodClass, build_request, target_source
from weightroll_operator.webhook import validate

from engine_agent.protocol import MANIFEST_DIGEST_PATTERN, SourceSpec
from tests.unit.weightroll_operator.builders import agent, pod, run, spec, state
from tests.unit.weightroll_operator.test_admission_rules import _cel_failures

ROOT = Path(__file__).resolve().parents[3]
PIN = "sha256:" + "ab" * 32
OTHER_PIN = "sha256:" + "cd" * 32
GOOD: dict[str, Any] = {
    "selector": {"matchLabels": {"app": "llm"}},
    "version": "v2",
    "source": {
        "uri": "file:///models/v2",
        "manifest": "/models/v2/weightroll-manifest.json",
        "manifestDigest": PIN,
    },
}
BAD_PINS = [
    "ab" * 32,  # no algorithm
    "sha256:" + "AB" * 32,  # upper case: not what weightroll manifest prints
    "sha256:" + "a" * 63,  # too short
    "sha256:" + "a" * 65,  # too long
    "sha512:" + "a" * 64,
    "sha256:" + "g" * 64,
    "sha256:" + "a" * 64 + "\n",
    "",
]


def _with_source(**changes: Any) -> dict[str, Any]:
    new = copy.deepcopy(GOOD)
    new["source"].update(changes)
    return {k: v for k, v in new.items()}


@pytest.mark.parametrize("pin", BAD_PINS)
def test_a_malformed_pin_is_refused_naming_the_field(pin: str) -> None:
    spec_dict = _with_source(manifestDigest=pin)
    with pytest.raises(ValueError, match=r"^spec\.source\.manifestDigest: "):
        parse_spec(spec_dict)
    problem = validate({"spec": spec_dict}, None)
    assert problem is not None and problem.startswith("spec.source.manifestDigest: "), problem
    # the API server's own check: the CRD's pattern refuses it too (its `$` is ECMA's, the end
    # of the text; Python's would also match before a final newline)
    pattern = _crd_source_schema()["properties"]["manifestDigest"]["pattern"]
    assert not re.fullmatch(pattern.removeprefix("^").removesuffix("$"), pin)


def test_a_pin_without_a_manifest_is_refused_by_webhook_and_cel() -> None:
    spec_dict = copy.deepcopy(GOOD)
    del spec_dict["source"]["manifest"]
    field = "spec.source.manifestDigest"
    problem = validate({"spec": spec_dict}, None)
    assert problem is not None and problem.startswith(field), problem
    cel = _cel_failures(spec_dict, None)
    assert cel and all(message.startswith(field) for message in cel), cel


def test_a_good_pin_is_accepted_and_sent_to_the_agent() -> None:
    assert validate({"spec": GOOD}, None) is None
    assert _cel_failures(GOOD, None) == []
    parsed = parse_spec(GOOD)
    assert parsed.source.manifest_digest == PIN
    probe = WeightState(state=UnitState.DRAINING, by=state().by, version="v2", update_id="wu-v2")
    request = build_request(parsed, probe)
    assert request.source.manifest_digest == PIN
    assert request.model_dump(by_alias=True, exclude_none=True)["source"] == GOOD["source"]
    assert target_source(parsed) == SourceRef(
        uri="file:///models/v2", manifest="/models/v2/weightroll-manifest.json", manifest_digest=PIN
    )


def test_the_crd_schema_carries_the_pattern_of_the_wire() -> None:
    schema = _crd_source_schema()["properties"]["manifestDigest"]
    assert schema == {
        "pattern": MANIFEST_DIGEST_PATTERN,
        "type": "string",
        "description": schema["description"],
    }
    assert "weightroll manifest" in schema["description"]


@pytest.mark.parametrize(("old_pin", "new_pin"), [(None, PIN), (PIN, OTHER_PIN), (PIN, None)])
def test_a_new_pin_under_the_same_version_is_a_new_source(
    old_pin: str | None, new_pin: str | None
) -> None:
    """Refused like any change of spec.source while spec.version stays (webhook and CEL)."""
    old = _with_source(manifestDigest=old_pin)
    new = _with_source(manifestDigest=new_pin)
    for each in (old, new):
        if each["source"]["manifestDigest"] is None:
            del each["source"]["manifestDigest"]
    problem = validate({"spec": new}, {"spec": old})
    assert problem is not None and problem.startswith("spec.source is immutable"), problem
    assert any(m.startswith("spec.source is immutable") for m in _cel_failures(new, old))
    new["version"] = "v3"
    assert validate({"spec": new}, {"spec": old}) is None


def test_a_verdict_without_the_pin_is_no_verdict_for_a_spec_that_pins() -> None:
    """A pod verified (and serving) v2 from the same files, but loaded unpinned, is updated
    again once the spec pins: the earlier load never checked the manifest against the pin."""
    pinned = spec(
        _spec={"source": {"uri": "/weights/v2", "manifest": "/m.json", "manifestDigest": PIN}}
    )
    unpinned = SourceRef(uri="/weights/v2", manifest="/m.json")
    verified = state(UnitState.VERIFIED, source=unpinned)
    p = run(pinned, [pod("p0", st=verified)], {"p0": agent("v2", source=unpinned)})
    claims = [a for a in p.actions if isinstance(a, Claim)]
    assert [c.pod.name for c in claims] == ["p0"], p.actions
    assert claims[0].state.source == target_source(pinned)
    assert f"pinned {PIN}" in p.notes["p0"], p.notes
    # once served from the pinned source the pod counts as updated, and the pin survives the
    # pod annotation
    p = run(pinned, [pod("p0")], {"p0": agent("v2", source=target_source(pinned))})
    assert p.classes["p0"] is PodClass.UPDATED
    stored = state(UnitState.VERIFIED, source=target_source(pinned))
    assert WeightState.from_json(stored.to_json()) == stored
    assert '"manifestDigest"' not in state(UnitState.VERIFIED, source=unpinned).to_json()


def test_the_wire_refuses_a_malformed_or_unanchored_pin() -> None:
    with pytest.raises(ValueError, match="manifestDigest"):
        SourceSpec.model_validate({"uri": "/m", "manifest": "/m/x.json", "manifestDigest": "x"})
    with pytest.raises(ValueError, match=r"source\.manifest is required"):
        SourceSpec.model_validate({"uri": "/m", "manifestDigest": PIN})


def _crd_source_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / crdgen.OUTPUTS[0]).read_text())
    version = crd["spec"]["versions"][0]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema["properties"]["source"]  # type: ignore[no-any-return]
