"""Sources read like vLLM reads them, and are verified on the very bytes the loaders consume.

Issue 10 item 5 (stale shard files) and item 6 (manifest checked on one read, loaded from
another): each test here fails against the reader that globbed ``*.safetensors`` and verified
in a separate pass.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_agent.errors import ManifestMismatch, SourceUnavailable
from engine_agent.manifest import ManifestError, build_manifest
from engine_agent.reload.sources import open_source


def _index(root: Path, weight_map: dict[str, str]) -> None:
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map})
    )


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """An indexed two-shard checkpoint plus a stale shard of an older save beside it."""
    root = tmp_path / "ckpt"
    root.mkdir()
    save_file({"a.weight": torch.full((4,), 1.0)}, str(root / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.full((4,), 2.0)}, str(root / "model-00002-of-00002.safetensors"))
    save_file({"a.weight": torch.full((4,), 9.0)}, str(root / "model-00001-of-00001.safetensors"))
    _index(
        root,
        {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
        },
    )
    return root


def test_an_index_selects_exactly_its_files_and_names(sharded: Path) -> None:
    source = open_source(str(sharded))
    assert [f.name for f in source.files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    loaded = dict(source.tensors())
    assert sorted(loaded) == ["a.weight", "b.weight"]
    assert torch.equal(loaded["a.weight"], torch.full((4,), 1.0)), "the stale shard was read"


def test_a_name_in_two_files_is_refused_naming_both(sharded: Path) -> None:
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(SourceUnavailable) as info:
        open_source(str(sharded))
    assert "'a.weight' appears in both" in info.value.message
    assert "model-00001-of-00001.safetensors" in info.value.message
    assert "model-00001-of-00002.safetensors" in info.value.message


def test_a_name_in_two_listed_files_is_refused_even_with_an_index(sharded: Path) -> None:
    save_file(
        {"b.weight": torch.full((4,), 2.0), "a.weight": torch.zeros(4)},
        str(sharded / "model-00002-of-00002.safetensors"),
    )
    with pytest.raises(SourceUnavailable, match="assigns to model-00001-of-00002"):
        open_source(str(sharded))


@pytest.mark.parametrize(
    ("weight_map", "message"),
    [
        ({"a.weight": "gone.safetensors"}, "gone.safetensors, which does not exist"),
        ({"a.weight": "../x.safetensors"}, "not a file in"),
        (
            {
                "a.weight": "model-00001-of-00002.safetensors",
                "c.weight": "model-00001-of-00002.safetensors",
            },
            "lists 'c.weight' in model-00001-of-00002.safetensors, which does not hold it",
        ),
    ],
)
def test_an_index_that_disagrees_with_the_files_is_refused(
    sharded: Path, weight_map: dict[str, str], message: str
) -> None:
    _index(sharded, weight_map)
    with pytest.raises(SourceUnavailable, match=message):
        open_source(str(sharded))


def test_the_manifest_follows_the_index_too(sharded: Path) -> None:
    manifest = build_manifest(sharded)
    assert sorted(manifest.tensors) == ["a.weight", "b.weight"]
    (sharded / "model.safetensors.index.json").unlink()
    with pytest.raises(ManifestError, match="appears in both"):
        build_manifest(sharded)


def _swap(path: Path, value: float) -> None:
    """Re-publish ``path`` with other bytes of the same shape (atomically, as a writer would)."""
    tmp = path.with_name(path.name + ".new")
    save_file({"a.weight": torch.full((4,), value)}, str(tmp))
    os.replace(tmp, path)


def test_files_swapped_after_the_headers_are_read_are_refused_on_the_bytes_loaded(
    sharded: Path,
) -> None:
    """The manifest is checked on the bytes handed to the loaders, not on an earlier read."""
    manifest = build_manifest(sharded)
    source = open_source(str(sharded), manifest=manifest)
    _swap(sharded / "model-00001-of-00002.safetensors", 5.0)
    handed: list[str] = []
    with pytest.raises(ManifestMismatch, match=r"a\.weight") as info:
        for name, _ in source.tensors():
            handed.append(name)
    assert "not the bytes the manifest pins" in info.value.message
    assert "a.weight" not in source.content_hashes


def test_a_mismatch_surfaces_before_the_batch_ends_or_at_complete(sharded: Path) -> None:
    manifest = build_manifest(sharded)
    _swap(sharded / "model-00001-of-00002.safetensors", 5.0)
    source = open_source(str(sharded), manifest=manifest)
    iterator = source.tensors()
    next(iterator)  # a.weight handed out, hashed in a worker
    with pytest.raises(ManifestMismatch):
        # The next tensor, the end of the batch, or complete(): never a clean return.
        for _ in iterator:
            pass
        source.complete()


def test_complete_refuses_tensors_that_were_never_hashed(sharded: Path) -> None:
    source = open_source(str(sharded), manifest=build_manifest(sharded))
    iterator = source.tensors()
    next(iterator)
    with pytest.raises(ManifestMismatch, match=r"not read and verified: b\.weight"):
        source.complete()


def test_every_tensor_handed_out_is_hashed_with_the_manifests_algorithm(sharded: Path) -> None:
    for algorithm in ("blake3", "sha256"):
        manifest = build_manifest(sharded, algorithm=algorithm)  # type: ignore[arg-type]
        source = open_source(str(sharded), manifest=manifest)
        list(source.tensors())
        source.complete()
        assert source.content_hashes == {n: e.content_hash for n, e in manifest.tensors.items()}
    unverified = open_source(str(sharded))
    list(unverified.tensors())
    assert unverified.content_hashes == {
        n: e.content_hash for n, e in build_manifest(sharded).tensors.items()
    }


def test_headers_that_disagree_with_the_manifest_are_refused_before_reading(sharded: Path) -> None:
    manifest = build_manifest(sharded)
    save_file({"a.weight": torch.zeros(5)}, str(sharded / "model-00001-of-00002.safetensors"))
    with pytest.raises(ManifestMismatch, match="shape"):
        open_source(str(sharded), manifest=manifest)


# -- issue 26, item 8: a FIFO in the checkpoint directory hung the load ------------------------
# Opening a named pipe for reading blocks until a writer appears, so each of these hung on main
# (safetensors opens holding the GIL: no pytest timeout can interrupt that, so none is set).


def test_a_fifo_among_the_shards_is_refused_by_name_without_opening_it(sharded: Path) -> None:
    (sharded / "model.safetensors.index.json").unlink()
    for stale in sharded.glob("model-*-of-00001.safetensors"):
        stale.unlink()
    os.mkfifo(sharded / "model-00003-of-00003.safetensors")
    with pytest.raises(SourceUnavailable) as info:
        open_source(str(sharded))
    assert "model-00003-of-00003.safetensors" in info.value.message
    assert "named pipe" in info.value.message and info.value.field == "path"


def test_a_fifo_as_the_index_or_a_listed_shard_is_refused_by_name(sharded: Path) -> None:
    index = sharded / "model.safetensors.index.json"
    listed = json.loads(index.read_text())
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(SourceUnavailable, match=r"model\.safetensors\.index\.json.*named pipe"):
        open_source(str(sharded))
    index.unlink()
    index.write_text(json.dumps(listed))
    shard = sharded / "model-00002-of-00002.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(SourceUnavailable, match=r"model-00002-of-00002\.safetensors.*named pipe"):
        open_source(str(sharded))


def test_a_fifo_as_the_manifest_is_refused_by_name(tmp_path: Path) -> None:
    from engine_agent.manifest import load_manifest

    os.mkfifo(tmp_path / "m.json")
    with pytest.raises(ManifestError, match=r"m\.json.*named pipe"):
        load_manifest(tmp_path / "m.json")
