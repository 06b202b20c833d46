"""The manifest pin (issue 28 item 5): ``sha256:`` of the manifest file's exact bytes.

``weightroll manifest`` prints the pin of the bytes it wrote; :func:`load_manifest` with
``pinned`` hashes the bytes it read once and parses only those, refusing any other file before
parsing it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine_agent import manifest as mf


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    weights = np.arange(32, dtype=np.float32).reshape(4, 8)
    save_file({"lm_head.weight": weights}, str(ckpt / "model.safetensors"))
    return ckpt


def test_the_cli_prints_the_pin_of_the_bytes_it_wrote(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert mf.main([str(checkpoint), "--version", "v2"]) == 0
    out, err = capsys.readouterr()
    written = (checkpoint / mf.DEFAULT_MANIFEST_NAME).read_bytes()
    pin = "sha256:" + hashlib.sha256(written).hexdigest()
    assert out == pin + "\n"
    assert f"pin it with spec.source.manifestDigest: {pin}" in err
    assert mf.load_manifest(checkpoint / mf.DEFAULT_MANIFEST_NAME, pinned=pin).version == "v2"

    # --out -: stdout is the manifest, the pin of exactly those bytes goes to stderr
    assert mf.main([str(checkpoint), "--version", "v2", "--out", "-"]) == 0
    out, err = capsys.readouterr()
    assert out.encode() == written
    assert err == f"manifestDigest: {pin}\n"


def test_a_pin_refuses_other_bytes_before_parsing_them(tmp_path: Path, checkpoint: Path) -> None:
    path = tmp_path / "weightroll-manifest.json"
    pin = mf.write_manifest(mf.build_manifest(checkpoint, version="v2"), path)
    assert pin == mf.manifest_file_digest(path.read_bytes())
    # a regenerated manifest for other weights, or any edit (here: indentation only)
    path.write_text(json.dumps(json.loads(path.read_text())))
    with pytest.raises(mf.ManifestDigestMismatch) as info:
        mf.load_manifest(path, pinned=pin)
    assert info.value.code == "manifest_digest_mismatch"
    assert "spec.source.manifestDigest" in str(info.value) and pin in str(info.value)
    mf.load_manifest(path)  # still a valid manifest: only the pin refuses it
    path.write_text("not json")  # checked before parsing: the pin is what is reported
    with pytest.raises(mf.ManifestDigestMismatch):
        mf.load_manifest(path, pinned=pin)


def test_the_pinned_bytes_are_the_parsed_bytes(
    tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One read: a manifest swapped after the hash cannot be what is parsed."""
    path = tmp_path / "weightroll-manifest.json"
    pin = mf.write_manifest(mf.build_manifest(checkpoint, version="v2"), path)
    other = mf.manifest_bytes(mf.build_manifest(checkpoint, version="v3"))
    reads: list[Path] = []
    real = Path.read_bytes

    def read_then_swap(self: Path) -> bytes:
        data = real(self)
        reads.append(self)
        self.write_bytes(other)  # the writer wins the race right after the read
        return data

    monkeypatch.setattr(Path, "read_bytes", read_then_swap)
    assert mf.load_manifest(path, pinned=pin).version == "v2"
    assert reads == [path]
