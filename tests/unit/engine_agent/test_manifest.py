"""Unit tests of ``engine_agent.manifest``: format, digest, streaming build, CLI and verify."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from safetensors.numpy import save_file

from engine_agent import manifest as mf
from engine_agent.manifest import build as mf_build


def _write_raw_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file by hand (lets us use BF16, which numpy lacks)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
        blobs.append(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(
        {
            "model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32),
            "model.norm.weight": np.ones(8, dtype=np.float32),
        },
        str(ckpt / "model-00001-of-00002.safetensors"),
    )
    _write_raw_safetensors(
        ckpt / "model-00002-of-00002.safetensors",
        {
            "lm_head.weight": ("BF16", [16, 8], rng.bytes(16 * 8 * 2)),
            "model.scalar": ("I64", [], struct.pack("<q", 7)),
        },
    )
    (ckpt / "config.json").write_text("{}")
    return ckpt


def _stored_bytes(path: Path, name: str) -> bytes:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, end = header[name]["data_offsets"]
    return raw[8 + length + begin : 8 + length + end]


def _hash(algorithm: str, data: bytes) -> str:
    return (
        blake3.blake3(data).hexdigest()
        if algorithm == "blake3"
        else hashlib.sha256(data).hexdigest()
    )


@pytest.mark.parametrize(
    ("algorithm", "fmt"),
    [("blake3", "weightroll.manifest/v2"), ("sha256", "weightroll.manifest/v1")],
)
def test_build_lists_every_tensor_with_raw_byte_hashes(
    checkpoint: Path, algorithm: Any, fmt: str
) -> None:
    manifest = mf.build_manifest(checkpoint, version="v2", algorithm=algorithm)
    assert manifest.format == fmt
    assert manifest.algorithm == algorithm

    assert sorted(manifest.tensors) == [
        "lm_head.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.scalar",
    ]
    lm = manifest.tensors["lm_head.weight"]
    assert lm.to_json() == {
        "file": "model-00002-of-00002.safetensors",
        "dtype": "BF16",
        "shape": [16, 8],
        "nbytes": 256,
        algorithm: _hash(
            algorithm,
            _stored_bytes(checkpoint / "model-00002-of-00002.safetensors", "lm_head.weight"),
        ),
    }
    assert manifest.tensors["model.scalar"].shape == ()
    assert manifest.total_bytes == 16 * 8 * 4 + 8 * 4 + 256 + 8
    assert manifest.version == "v2"
    assert manifest.base_version is None
    assert manifest.digest == mf.tensors_digest(manifest.tensors)


def test_digest_is_sha256_of_canonical_tensors_json(checkpoint: Path) -> None:
    manifest = mf.build_manifest(checkpoint)
    written = manifest.to_json()
    canonical = json.dumps(written["tensors"], sort_keys=True, separators=(",", ":"))
    assert manifest.digest == hashlib.sha256(canonical.encode()).hexdigest()


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_write_then_load_round_trips(checkpoint: Path, tmp_path: Path, algorithm: Any) -> None:
    manifest = mf.build_manifest(checkpoint, version="v2", base_version="v1", algorithm=algorithm)
    out = tmp_path / "m.json"
    mf.write_manifest(manifest, out)
    document = json.loads(out.read_text())
    assert document["format"] == {"blake3": mf.FORMAT_V2, "sha256": mf.FORMAT_V1}[algorithm]
    assert document["baseVersion"] == "v1"
    assert set(document) == {"format", "version", "baseVersion", "tensors", "totalBytes", "digest"}
    assert mf.load_manifest(out) == manifest
    assert list(tmp_path.glob(".m.json.tmp*")) == []


def test_entry_returns_none_for_unknown(checkpoint: Path) -> None:
    manifest = mf.build_manifest(checkpoint)
    assert manifest.entry("model.norm.weight") is not None
    assert manifest.entry("nope") is None
    assert manifest.files() == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["tensors"]["model.norm.weight"].update(blake3="0" * 64), "digest mismatch"),
        (lambda d: d.update(digest="f" * 64), "digest mismatch"),
        (lambda d: d.update(totalBytes=1), "totalBytes"),
        (lambda d: d.update(format="other/v9"), "format"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d.update(version="not a version!"), "version"),
        (lambda d: d["tensors"]["model.norm.weight"].update(file="../x"), "relative"),
        (lambda d: d["tensors"]["model.norm.weight"].update(dtype="F7"), "unknown safetensors"),
        (lambda d: d["tensors"]["model.norm.weight"].update(nbytes=3), "nbytes"),
        (lambda d: d["tensors"]["model.norm.weight"].update(blake3="XYZ"), "blake3"),
        (lambda d: d["tensors"]["model.norm.weight"].update(sha256="0" * 64), "exactly one"),
        (lambda d: d.update(format=mf.FORMAT_V1), "carry sha256"),
        (lambda d: d.pop("tensors"), "tensors"),
    ],
)
def test_load_rejects_bad_manifests_naming_the_problem(
    checkpoint: Path, tmp_path: Path, edit: Any, message: str
) -> None:
    document = mf.build_manifest(checkpoint).to_json()
    edit(document)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(mf.ManifestError, match=message):
        mf.load_manifest(path)


def test_digest_mismatch_is_a_mismatch_error(checkpoint: Path, tmp_path: Path) -> None:
    document = mf.build_manifest(checkpoint).to_json()
    document["tensors"]["model.norm.weight"]["blake3"] = "0" * 64
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(mf.ManifestMismatch) as info:
        mf.load_manifest(path)
    assert info.value.code == "manifest_mismatch"


def test_load_missing_and_non_json(tmp_path: Path) -> None:
    with pytest.raises(mf.ManifestError, match="cannot read manifest"):
        mf.load_manifest(tmp_path / "absent.json")
    (tmp_path / "x.json").write_text("{nope")
    with pytest.raises(mf.ManifestError, match="not valid JSON"):
        mf.load_manifest(tmp_path / "x.json")


@pytest.mark.parametrize("algorithm", ["blake3", "sha256"])
def test_verify_checks_name_dtype_shape_size_and_hash(checkpoint: Path, algorithm: Any) -> None:
    manifest = mf.build_manifest(checkpoint, algorithm=algorithm)
    file = checkpoint / "model-00001-of-00002.safetensors"
    good = _stored_bytes(file, "model.norm.weight")
    entry = manifest.verify("model.norm.weight", good, dtype="F32", shape=[8])
    assert entry.nbytes == 32
    assert manifest.verify("model.norm.weight", np.frombuffer(good, dtype=np.float32))
    with pytest.raises(mf.ManifestMismatch, match="not listed"):
        manifest.verify("other", good)
    with pytest.raises(mf.ManifestMismatch, match="dtype F16"):
        manifest.verify("model.norm.weight", good, dtype="F16")
    with pytest.raises(mf.ManifestMismatch, match=r"shape \[2, 4\]"):
        manifest.verify("model.norm.weight", good, shape=(2, 4))
    with pytest.raises(mf.ManifestMismatch, match="4 bytes"):
        manifest.verify("model.norm.weight", good[:4])
    flipped = bytes([good[0] ^ 1]) + good[1:]
    with pytest.raises(mf.ManifestMismatch, match=algorithm):
        manifest.verify("model.norm.weight", flipped)


def test_sha256_hex_accepts_buffers_and_rejects_strided() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    expected = hashlib.sha256(array.tobytes()).hexdigest()
    assert mf.sha256_hex(array) == expected
    assert mf.sha256_hex(array.tobytes()) == expected
    assert mf.sha256_hex(memoryview(array.tobytes())) == expected
    with pytest.raises(BufferError):
        mf.sha256_hex(array[:, ::2])


def test_build_streams_in_chunks(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor larger than a chunk hashes the same as when read whole."""
    whole = mf.build_manifest(checkpoint)
    monkeypatch.setattr(mf_build, "CHUNK_BYTES", 7)  # read where the build reads it
    assert mf.build_manifest(checkpoint) == whole


def test_build_single_file(checkpoint: Path) -> None:
    manifest = mf.build_manifest(checkpoint / "model-00001-of-00002.safetensors")
    assert sorted(manifest.tensors) == ["model.embed_tokens.weight", "model.norm.weight"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[:-4], "outside the file"),
        (lambda raw: raw[:5], "no header length"),
        (lambda raw: struct.pack("<Q", 10**12) + raw[8:], "implausible"),
        (lambda raw: raw[:8] + b"[" + raw[9:], "not JSON"),
    ],
)
def test_build_rejects_corrupt_files(checkpoint: Path, damage: Any, message: str) -> None:
    path = checkpoint / "model-00002-of-00002.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(mf.ManifestError, match=message):
        mf.build_manifest(checkpoint)


def test_build_rejects_duplicates_empty_and_missing(checkpoint: Path, tmp_path: Path) -> None:
    save_file({"model.norm.weight": np.zeros(8, np.float32)}, str(checkpoint / "z.safetensors"))
    with pytest.raises(mf.ManifestError, match="appears in both"):
        mf.build_manifest(checkpoint)
    (tmp_path / "empty").mkdir()
    with pytest.raises(mf.ManifestError, match=r"no \*\.safetensors"):
        mf.build_manifest(tmp_path / "empty")
    with pytest.raises(mf.ManifestError, match="does not exist"):
        mf.build_manifest(tmp_path / "absent")
    with pytest.raises(mf.ManifestError, match="not a valid version"):
        mf.build_manifest(tmp_path / "ckpt", version="bad version")
    with pytest.raises(mf.ManifestError, match="base_version"):
        mf.build_manifest(tmp_path / "ckpt", base_version="-x")


def test_cli_writes_default_and_explicit_paths(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mf.main([str(checkpoint), "--version", "v2"]) == 0
    default = mf.load_manifest(checkpoint / mf.DEFAULT_MANIFEST_NAME)
    assert default.version == "v2"
    out = tmp_path / "delta.json"
    assert mf.main([str(checkpoint), "--out", str(out), "--base-version", "v1"]) == 0
    assert mf.load_manifest(out).base_version == "v1"
    capsys.readouterr()
    assert mf.main([str(checkpoint), "--out", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == default.digest


def test_cli_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mf.main([str(tmp_path / "absent")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        mf.main([])
    assert info.value.code == 2


def test_cli_dispatch_through_weightroll(checkpoint: Path) -> None:
    cli = pytest.importorskip("weightroll_operator.cli")
    out = checkpoint.parent / "via-cli.json"
    assert cli.main(["manifest", str(checkpoint), "--out", str(out)]) == 0
    assert mf.load_manifest(out).tensors
