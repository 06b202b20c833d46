"""``weightroll lint``: manifests checked offline with the admission webhook's own validator
(issue 31 item 2). Every example of the repository lints clean; a broken spec names its field;
other documents are skipped; unreadable input exits 2 in one line."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from weightroll_operator import cli
from weightroll_operator.lint import lint_text
from weightroll_operator.webhook import validate

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*/*.yaml"))
BASIC = yaml.safe_load((ROOT / "examples" / "01-basic" / "weightupdate.yaml").read_text())


def _lint(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["lint", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.parent.name)
def test_every_example_lints_clean(example: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _lint(capsys, str(example))
    assert (code, err) == (0, ""), out
    assert out.strip().endswith(": ok")


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(BASIC)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("spec", "version"), "V2_1", "spec.version"),
        (("spec", "strategy", "progressDeadlineSeconds"), 600, "progressDeadlineSeconds"),
        (("spec", "strategy", "maxUnavailable"), 0, "spec.strategy.maxUnavailable"),
        (("spec", "selector"), {}, "spec.selector"),
        (("metadata", "name"), "Llama_V2", "metadata.name"),
        (("apiVersion",), "weightroll.io/v9", "apiVersion"),
    ],
)
def test_a_broken_spec_names_its_field_and_fails(
    path: tuple[str, ...],
    value: Any,
    named: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "wu.yaml"
    bad.write_text(yaml.safe_dump(_with(path, value)))
    code, out, _ = _lint(capsys, str(bad))
    assert code == 1, out
    assert named in out and out.count("\n") == 1


def test_other_documents_are_skipped_and_each_weightupdate_is_judged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "tok"}}
    broken = _with(("spec", "version"), "")
    broken["metadata"]["name"] = "broken"
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump_all([secret, BASIC, None, broken]))
    code, out, _ = _lint(capsys, str(path))
    lines = out.splitlines()
    assert code == 1
    assert lines[0] == f"{path}: tok: skipped: Secret v1"
    assert lines[1] == f"{path}: llama-v2: ok"
    assert lines[2].startswith(f"{path}: broken: ") and "spec.version" in lines[2]
    assert len(lines) == 3


@pytest.mark.parametrize(
    ("content", "said"),
    [(None, "cannot read it (No such file or directory)"), (b"a: [1\n", "not YAML at line 2")],
)
def test_unreadable_input_is_one_line_and_exit_2(
    content: bytes | None, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "wu.yaml"
    if content is not None:
        path.write_bytes(content)
    code, out, err = _lint(capsys, str(path), str(EXAMPLES[0]))
    assert code == 2
    assert err == f"weightroll lint: {path}: {said}\n"
    assert out.strip().endswith(": ok"), "the other files are still checked"


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["version", "source", "selector", "strategy", "agent", "paused"]),
        st.one_of(st.none(), st.text(max_size=5), st.integers(-5, 5), st.just({})),
        max_size=4,
    )
)
def test_lint_and_admission_agree_on_generated_specs(changes: dict[str, Any]) -> None:
    """The same verdict as the webhook for any spec: lint is admission, offline."""
    doc = copy.deepcopy(BASIC)
    doc["spec"].update(changes)
    ((name, problem),) = lint_text(yaml.safe_dump(doc))
    assert name == "llama-v2"
    assert problem == validate(doc, None)
