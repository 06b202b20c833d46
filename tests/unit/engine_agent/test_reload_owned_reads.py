"""A source hashes the bytes it hands out, and nothing reads the file again (issue 26, item 2).

safetensors hands out mmap views of the page cache; the hash pool used to hash those views on
worker threads after the loaders had copied them, so a file rewritten in place in between
(``rsync --inplace``) was verified with other bytes than were loaded. Every test here fails
against that reader. The hash workers are held back until ``drain`` (:func:`hash_at_drain`), so
"the loader copied, then the file changed, then the hash ran" is an order, not a race.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine_agent.errors import ManifestMismatch, SourceUnavailable
from engine_agent.manifest import build_manifest, content_hash
from engine_agent.reload import digest
from engine_agent.reload.digest import host_bytes
from engine_agent.reload.sources import open_source
from engine_agent.reload.sparse import read_patches, write_patch
from tests.harness.inplace import rewrite_in_place

#: The bytes the manifest pins, and other bytes of the same layout the file holds at first.
PINNED = torch.arange(64, dtype=torch.float32)
OTHER = PINNED + 1000


@pytest.fixture
def hash_at_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make :class:`VerifyPool` hash only when drained: after the caller used every tensor."""
    submit, drain = digest.VerifyPool.submit, digest.VerifyPool.drain

    def later(self: Any, name: str, tensor: torch.Tensor, check: Callable[..., None]) -> None:
        self.__dict__.setdefault("later", []).append((name, tensor, check))

    def now(self: Any) -> None:
        for item in self.__dict__.pop("later", []):
            submit(self, *item)
        drain(self)

    monkeypatch.setattr(digest.VerifyPool, "submit", later)
    monkeypatch.setattr(digest.VerifyPool, "drain", now)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": PINNED, "b.weight": torch.ones(8)}, str(path))
    return path


def test_a_rewrite_after_the_loaders_copy_cannot_pass_the_manifest(
    checkpoint: Path, hash_at_drain: None
) -> None:
    manifest = build_manifest(checkpoint)  # pins PINNED
    rewrite_in_place(checkpoint, "a.weight", OTHER)  # what the file holds when the load starts
    source = open_source(str(checkpoint), manifest=manifest)
    tensors = source.tensors()
    name, tensor = next(tensors)
    assert name == "a.weight"
    loaded = tensor.clone()  # the loader's copy
    rewrite_in_place(checkpoint, "a.weight", PINNED)  # the writer finishes before the hash
    with pytest.raises(ManifestMismatch) as info:
        list(tensors)
        source.complete()
    assert info.value.field == "a.weight"
    assert torch.equal(loaded, OTHER), "the loader got the bytes the manifest does not pin"


def test_without_a_manifest_the_recorded_hash_is_of_the_bytes_handed_out(
    checkpoint: Path, hash_at_drain: None
) -> None:
    source = open_source(str(checkpoint))
    tensors = source.tensors()
    _, tensor = next(tensors)
    loaded = tensor.clone()
    rewrite_in_place(checkpoint, "a.weight", OTHER)
    rest = dict(tensors)
    source.complete()
    assert torch.equal(loaded, PINNED)
    assert source.content_hashes["a.weight"] == content_hash(host_bytes(loaded), "blake3")
    assert source.content_hashes["b.weight"] == content_hash(host_bytes(rest["b.weight"]))


def test_a_tensor_handed_out_is_not_a_view_of_the_file(checkpoint: Path) -> None:
    source = open_source(str(checkpoint))
    tensors = dict(source.tensors())
    source.complete()
    rewrite_in_place(checkpoint, "a.weight", OTHER)
    assert torch.equal(tensors["a.weight"], PINNED)


def test_a_sparse_patch_applies_the_values_it_verified(tmp_path: Path) -> None:
    path = write_patch(
        tmp_path / "p.safetensors",
        "a",
        {"w": ((4, 16), torch.tensor([1, 7, 9]), torch.tensor([1.0, 2.0, 3.0]))},
    )
    manifest = build_manifest(path, base_version="a")
    source = open_source(str(path), manifest=manifest)
    ((_, _, indices, values),) = read_patches(source)
    source.complete()  # verified
    rewrite_in_place(path, "w::values", torch.tensor([-1.0, -2.0, -3.0]))
    rewrite_in_place(path, "w::indices", torch.tensor([0, 0, 0]))
    # What LoadRouter.apply_sparse reads after the check: still the verified bytes.
    assert torch.equal(values, torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(indices, torch.tensor([1, 7, 9]))


def test_a_file_whose_layout_changed_after_the_headers_were_checked_is_refused(
    checkpoint: Path, tmp_path: Path
) -> None:
    source = open_source(str(checkpoint))  # headers read: a.weight is 64 float32
    staged = tmp_path / "staged.safetensors"
    save_file({"a.weight": PINNED.reshape(8, 8), "b.weight": torch.ones(8)}, str(staged))
    os.replace(staged, checkpoint)
    with pytest.raises(SourceUnavailable, match="changed while the update ran") as info:
        list(source.tensors())
    assert info.value.field == "a.weight"


def test_a_file_truncated_after_the_headers_were_checked_is_refused(checkpoint: Path) -> None:
    source = open_source(str(checkpoint))
    size = checkpoint.stat().st_size
    with checkpoint.open("r+b") as handle:
        handle.truncate(size - 4)
    with pytest.raises(SourceUnavailable):
        list(source.tensors())


def test_tensors_read_ahead_are_each_their_own_buffer_and_stop_with_the_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine_agent.reload import owned_reads

    monkeypatch.setattr(owned_reads, "READ_AHEAD_BYTES", 3 * 1024)  # 3 ahead
    path = tmp_path / "layers.safetensors"
    expected = {f"l{i:02}.weight": torch.full((256,), float(i)) for i in range(12)}
    save_file(expected, str(path))
    kept = dict(open_source(str(path)).tensors())  # a loader that keeps everything
    assert all(torch.equal(kept[n], t) for n, t in expected.items())
    assert len({t.data_ptr() for t in kept.values()}) == len(expected)
    # A loader that fails after the first tensor: the reader stops, nothing is left running.
    source = open_source(str(path))
    tensors = source.tensors()
    next(tensors)
    tensors.close()
    with pytest.raises(ManifestMismatch, match="not read and verified"):
        source.complete()


def test_a_file_republished_with_other_offsets_is_read_where_its_header_now_says(
    checkpoint: Path, tmp_path: Path
) -> None:
    manifest = build_manifest(checkpoint)
    source = open_source(str(checkpoint), manifest=manifest)
    staged = tmp_path / "staged.safetensors"
    # Same names, dtypes and shapes; a longer header moves every tensor's data.
    save_file({"a.weight": OTHER, "b.weight": torch.ones(8)}, str(staged), {"pad": "x" * 100})
    os.replace(staged, checkpoint)
    tensors = source.tensors()
    _, tensor = next(tensors)
    assert torch.equal(tensor, OTHER)
    with pytest.raises(ManifestMismatch) as info:
        list(tensors)
        source.complete()
    assert info.value.field == "a.weight"
