"""Real engine: the bytes a rank hashes are the bytes it loads (issue 26, item 2).

safetensors hands out mmap views of the checkpoint; the hash workers hashed those views after
the loaders had copied them, and a sparse patch was verified and then read from the file again
by ``apply_sparse``. A file rewritten in place in between (``rsync --inplace``) then committed
bytes the manifest does not pin, under a matching digest. Here the writer is made to land
exactly in that window: the hash pool is held back until it is drained (the engine drains it
before its first live write), and the checkpoint changes first; the sparse patch changes right
after its verification. Each test fails against the mmap reader.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_agent.manifest import build_manifest, write_manifest
from engine_agent.reload import digest, modelwise
from engine_agent.reload.sources import open_source
from engine_agent.reload.sparse import write_patch
from tests.harness.engines import Engine, start_engine
from tests.harness.inplace import rewrite_in_place
from tests.harness.models import load_tensors

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def engine(checkpoints: Callable[[str, int], Path]) -> Iterator[Engine]:
    started = start_engine(checkpoints("llama", 0))
    started.boot_version = started.state()[0]["version"]  # type: ignore[attr-defined]
    started.boot_outputs = started.outputs()  # type: ignore[attr-defined]
    yield started
    started.close()


@pytest.fixture
def engine_at_boot(engine: Engine, checkpoints: Callable[[str, int], Path]) -> Engine:
    """The engine clean at its boot weights (a full update restores them if a test moved it)."""
    boot = engine.boot_version  # type: ignore[attr-defined]
    state = engine.state()[0]
    if state["state"] != "clean" or state["version"] != boot:
        if state["state"] in ("open", "dirty"):
            engine.rpc("weightroll_abort")
        restored = engine.update(f"restore-{id(state)}", boot, checkpoints("llama", 0))
        assert restored[0]["ok"], restored
    return engine


def _file(directory: Path) -> Path:
    (file,) = sorted(directory.glob("*.safetensors"))
    return file


def _hash_after_the_writer(
    monkeypatch: pytest.MonkeyPatch, file: Path, name: str, final: torch.Tensor
) -> list[str]:
    """Hold the pool's hashing back until it is drained; the writer finishes right before.

    The first drain comes before the first live write, after the loaders copied the first
    tensors into staging: ``name`` (handed out first) is then rewritten to ``final`` and only
    then hashed. Returns the names hashed after the rewrite (to check the window was hit).
    """
    submit, drain = digest.VerifyPool.submit, digest.VerifyPool.drain
    late: list[str] = []

    def later(self: Any, tensor_name: str, tensor: torch.Tensor, check: Any) -> None:
        self.__dict__.setdefault("later", []).append((tensor_name, tensor, check))

    def now(self: Any) -> None:
        held = self.__dict__.pop("later", [])
        if not late and any(n == name for n, _, _ in held):
            rewrite_in_place(file, name, final)
            late.extend(n for n, _, _ in held)
        for item in held:
            submit(self, *item)
        drain(self)

    monkeypatch.setattr(digest.VerifyPool, "submit", later)
    monkeypatch.setattr(digest.VerifyPool, "drain", now)
    return late


def _first_tensor(directory: Path) -> str:
    return next(iter(open_source(str(directory)).infos))


def _differs(tensor: torch.Tensor) -> torch.Tensor:
    other = (tensor.float() + 1).to(tensor.dtype)
    assert not torch.equal(other, tensor)
    return other


def test_a_checkpoint_rewritten_in_place_after_the_loaders_copy_is_refused(
    engine_at_boot: Engine,
    checkpoints: Callable[[str, int], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_at_boot
    source = Path(shutil.copytree(checkpoints("llama", 1), tmp_path / "b"))
    write_manifest(build_manifest(source, version="b"), source / "m.json")  # pins B
    name = _first_tensor(source)
    pinned = load_tensors(source)[name].clone()  # not a view of the file we rewrite
    rewrite_in_place(_file(source), name, _differs(pinned))  # the file as the load starts
    late = _hash_after_the_writer(monkeypatch, _file(source), name, pinned)

    assert engine.rpc("weightroll_begin", {"updateId": "inplace-1", "version": "b"})[0]["ok"]
    load = engine.rpc("weightroll_load", {"path": str(source), "manifest": str(source / "m.json")})
    finish = engine.rpc("weightroll_finish")

    assert name in late, "the writer did not land between the loaders' copy and the hash"
    assert not load[0]["ok"] and load[0]["error"]["code"] == "manifest_mismatch", load
    assert load[0]["error"]["field"] == name
    assert not finish[0]["ok"], "bytes the manifest does not pin were committed under it"
    (state,) = engine.state()
    assert state["state"] == "clean", "refused before the first live write: the rank is clean"
    assert state["version"] == engine.boot_version  # type: ignore[attr-defined]
    assert engine.outputs() == engine.boot_outputs  # type: ignore[attr-defined]


def test_without_a_manifest_the_digest_is_of_the_bytes_loaded(
    engine_at_boot: Engine,
    checkpoints: Callable[[str, int], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = engine_at_boot
    source = Path(shutil.copytree(checkpoints("llama", 1), tmp_path / "b"))
    name = _first_tensor(source)
    final = load_tensors(source)[name].clone()  # not a view of the file we rewrite
    loaded = _differs(final)
    rewrite_in_place(_file(source), name, loaded)
    expected = build_manifest(source).rank_digest()  # the digest of the bytes as the load starts
    late = _hash_after_the_writer(monkeypatch, _file(source), name, final)

    (report,) = engine.update("inplace-2", "b", source)

    assert name in late, "the writer did not land between the loaders' copy and the hash"
    assert report["ok"], report
    live = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0]
    assert torch.equal(live[name], loaded), "the rank loaded the bytes present at the copy"
    assert report["digest"] == expected, "the digest names other bytes than the rank loaded"
    assert report["digest"] != build_manifest(source).rank_digest()


@pytest.mark.parametrize("pinned", [True, False], ids=["manifest", "no-manifest"])
def test_a_sparse_patch_rewritten_after_its_verification_applies_the_verified_bytes(
    engine_at_boot: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pinned: bool
) -> None:
    engine = engine_at_boot
    boot = engine.boot_version  # type: ignore[attr-defined]
    before = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0][NORM]
    indices = torch.tensor([1, 5, 17])
    verified = torch.tensor([2.0, -3.0, 4.0], dtype=before.dtype)
    path = write_patch(
        tmp_path / "p.safetensors", boot, {NORM: (tuple(before.shape), indices, verified)}
    )
    manifest = tmp_path / "m.json"
    write_manifest(build_manifest(path, version="s", base_version=boot), manifest)
    apply_sparse = modelwise.LoadRouter.apply_sparse

    def rewritten_after_the_check(self: Any, patches: Any) -> Any:
        rewrite_in_place(path, f"{NORM}::values", torch.full_like(verified, 7.0))
        rewrite_in_place(path, f"{NORM}::indices", torch.tensor([0, 2, 3]))
        return apply_sparse(self, patches)

    monkeypatch.setattr(modelwise.LoadRouter, "apply_sparse", rewritten_after_the_check)
    committed = engine.state()[0]["committedUpdateId"]
    update_id = f"sparse-{str(pinned).lower()}"
    begin = {"updateId": update_id, "version": "s", "mode": "sparse", "baseVersion": boot}
    assert engine.rpc("weightroll_begin", begin | {"baseUpdateId": committed})[0]["ok"]
    load_args = {"path": str(path)} | ({"manifest": str(manifest)} if pinned else {})
    load = engine.rpc("weightroll_load", load_args)
    assert load[0]["ok"], load
    (finish,) = engine.rpc("weightroll_finish")
    assert finish["ok"], finish

    after = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0][NORM]
    expected = before.clone()
    expected[indices] = verified
    assert torch.equal(after, expected), "the rank applied other bytes than it verified"
