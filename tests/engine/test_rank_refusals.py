"""Real engine: a rank refuses by name what its caller should not have sent (issue 26, item 8
and the trainer path's ``shape_mismatch`` of item 9), and stays exactly as it was.

Each test failed on main: the rank loaded a manifest of another version, acknowledged a second
``begin`` of its open update with another spec while dirty, answered ``internal`` to a sparse
patch with malformed shape metadata, and refused a wrong-shaped tensor without naming it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine_agent.manifest import build_manifest, write_manifest
from engine_agent.reload.sparse import write_patch
from tests.harness.engines import Engine, start_engine
from tests.harness.models import load_tensors

NORM = "model.norm.weight"
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def engine(checkpoints: Callable[[str, int], Path]) -> Iterator[Engine]:
    started = start_engine(checkpoints("llama", 0))
    yield started
    started.close()


@pytest.fixture(autouse=True)
def settled(engine: Engine, checkpoints: Callable[[str, int], Path]) -> Iterator[None]:
    """Whatever a test leaves behind, the next one starts on a clean engine."""
    yield
    state, _, _ = _serving(engine)
    if state in ("open", "dirty"):
        engine.rpc("weightroll_abort")
    if _serving(engine)[0] != "clean":
        assert _only(engine.update("settle", "a", checkpoints("llama", 0)))["ok"]


def _only(reports: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(reports) == 1
    return reports[0]


def _serving(engine: Engine) -> tuple[str, str, str | None]:
    state = _only(engine.state())
    return state["state"], state["version"], state.get("committedUpdateId")


def test_a_manifest_of_another_version_is_refused_by_the_rank(
    engine: Engine, checkpoints: Callable[[str, int], Path], tmp_path: Path
) -> None:
    """The agent checks the manifest's version; a rank driven without it (or by a caller that
    skipped the check) loaded bytes whose manifest names another version under this one."""
    before = _serving(engine)
    source = Path(shutil.copytree(checkpoints("llama", 1), tmp_path / "c"))
    write_manifest(build_manifest(source, version="c"), source / "m.json")
    begin = _only(engine.rpc("weightroll_begin", {"updateId": "mv-1", "version": "b"}))
    assert begin["ok"], begin
    load = _only(
        engine.rpc("weightroll_load", {"path": str(source), "manifest": str(source / "m.json")})
    )
    assert not load["ok"] and load["error"]["code"] == "manifest_mismatch", load
    assert "'c'" in load["error"]["message"] and "'b'" in load["error"]["message"], load
    assert load["bytesLoaded"] == 0, load
    assert _serving(engine) == before, "refused before any write: still clean at its version"


def test_a_repeated_begin_with_another_spec_is_a_conflict_while_dirty(
    engine: Engine, checkpoints: Callable[[str, int], Path]
) -> None:
    spec = {"updateId": "rb-1", "version": "b"}
    assert _only(engine.rpc("weightroll_begin", spec))["ok"]
    assert _only(engine.rpc("weightroll_load", {"path": str(checkpoints("llama", 1))}))["ok"]
    assert _serving(engine)[0] == "dirty"
    other = _only(engine.rpc("weightroll_begin", {**spec, "version": "c"}))
    assert not other["ok"] and other["error"]["code"] == "update_conflict", other
    assert "'b' began, 'c' now" in other["error"]["message"], other
    # The retried begin of the same request is still acknowledged, and the session goes on.
    assert _only(engine.rpc("weightroll_begin", spec))["ok"]
    finish = _only(engine.rpc("weightroll_finish"))
    assert finish["ok"] and finish["version"] == "b", finish


def _raw_patch(path: Path, base: str, name: str, shape: str) -> Path:
    metadata = {"weightroll.sparse": "v1", "weightroll.base_version": base, f"shape::{name}": shape}
    tensors = {
        f"{name}::indices": torch.tensor([0, 1]),
        f"{name}::values": torch.zeros(2, dtype=torch.bfloat16),
    }
    save_file(tensors, str(path), metadata)
    return path


def test_malformed_sparse_patches_are_refused_by_name_before_any_write(
    engine: Engine, checkpoints: Callable[[str, int], Path], tmp_path: Path
) -> None:
    _, version, _ = before = _serving(engine)
    embed = load_tensors(checkpoints("llama", 0))[EMBED]
    patches = {
        "negative": (_raw_patch(tmp_path / "neg.safetensors", version, NORM, "-1"), NORM),
        "not-a-number": (_raw_patch(tmp_path / "nan.safetensors", version, NORM, "x,y"), NORM),
        # flattened: the embedding's loader rejects it with a bare assert (no message at all)
        "flattened": (
            write_patch(
                tmp_path / "flat.safetensors",
                version,
                {
                    EMBED: (
                        (embed.numel(),),
                        torch.tensor([0, 1]),
                        torch.zeros(2, dtype=embed.dtype),
                    )
                },
            ),
            EMBED,
        ),
    }
    for case, (patch, name) in patches.items():
        report = _only(engine.update(f"bad-{case}", "x", patch, mode="sparse", baseVersion=version))
        assert not report["ok"], (case, report)
        error = report["error"]
        assert error["code"] in ("invalid_request", "shape_mismatch"), (case, error)
        assert error["field"] == name and name in error["message"], (case, error)
        assert _serving(engine) == before, case


def test_a_tensor_the_loader_rejects_is_named_on_the_trainer_path(engine: Engine) -> None:
    """A pushed tensor of the wrong shape: ``shape_mismatch`` used to say only "the model's weight
    loader rejected a tensor", so a trainer could not tell which of its tensors was wrong."""
    before = _serving(engine)

    def push_wrong_shape(worker: Any) -> dict[str, Any]:
        rank = worker._weightroll_engine()
        begun = rank.begin(json.dumps({"updateId": "push-shape", "version": "p"}))
        assert begun["ok"], begun
        report: dict[str, Any] = rank.load_tensors([(NORM, torch.zeros(7, dtype=torch.bfloat16))])
        return report

    (report,) = engine.llm.collective_rpc(push_wrong_shape)
    assert not report["ok"] and report["error"]["code"] == "shape_mismatch", report
    assert report["error"]["field"] == NORM, report
    assert NORM in report["error"]["message"] and "[7]" in report["error"]["message"], report
    assert _serving(engine) == before
