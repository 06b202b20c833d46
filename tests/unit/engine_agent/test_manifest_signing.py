"""Signed manifests (issue 28 item 5): ``engine_agent.sidecar.signing`` with real model-signing
bundles over keys generated here.

The agent verifies ``<manifest>.sig`` over the bytes it read once, parses those same bytes, and
requires the signed ``version`` to be the update's; a bad key or a missing ``model_signing``
package is a start-up error naming the setting.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from safetensors.numpy import save_file

from engine_agent import manifest as mf
from engine_agent.sidecar import signing
from engine_agent.sidecar.signing import (
    ManifestSignatureInvalid,
    ManifestVerifier,
    SigningUnavailable,
)
from tests.harness.signing_keys import sign, write_key_pair

pytest.importorskip(
    "model_signing", reason="the signing extra (pip install -e '.[dev]') is not installed"
)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    return write_key_pair(tmp_path, "publisher")


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(
        {"lm_head.weight": np.arange(32, dtype=np.float32).reshape(4, 8)},
        str(ckpt / "model.safetensors"),
    )
    path = ckpt / mf.DEFAULT_MANIFEST_NAME
    mf.write_manifest(mf.build_manifest(ckpt, version="v2"), path)
    return path


def test_a_signed_manifest_loads_with_the_pin_of_the_verified_bytes(
    manifest: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    sign(manifest, private)

    loaded, pin = ManifestVerifier.load(public).load_manifest(str(manifest), version="v2")

    assert loaded.version == "v2"
    assert pin == mf.manifest_file_digest(manifest.read_bytes())
    # an update's own pin is checked as well
    pinned = ManifestVerifier(public).load_manifest(str(manifest), version="v2", pinned=pin)
    assert pinned[1] == pin


def test_a_manifest_changed_after_signing_is_refused(
    manifest: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    sign(manifest, private)
    document = json.loads(manifest.read_bytes())
    document["baseVersion"] = "v1"  # any byte: the signature covers the whole file
    manifest.write_text(json.dumps(document, indent=2) + "\n")

    with pytest.raises(ManifestSignatureInvalid) as info:
        ManifestVerifier(public).load_manifest(str(manifest), version="v2")

    assert info.value.code == "manifest_signature_invalid"
    assert "--manifest-public-key" in str(info.value) and str(public) in str(info.value)
    assert "mismatch" in str(info.value).lower()


def test_a_signature_by_another_key_is_refused(
    manifest: Path, keys: tuple[Path, Path], tmp_path: Path
) -> None:
    _, public = keys
    other_private, _ = write_key_pair(tmp_path, "attacker")
    sign(manifest, other_private)

    with pytest.raises(ManifestSignatureInvalid, match="not signed by the key"):
        ManifestVerifier(public).load_manifest(str(manifest), version="v2")


def test_a_missing_or_oversized_signature_is_refused(
    manifest: Path, keys: tuple[Path, Path]
) -> None:
    _, public = keys
    with pytest.raises(ManifestSignatureInvalid, match=r"no readable signature .*\.sig"):
        ManifestVerifier(public).load_manifest(str(manifest), version="v2")
    signature = manifest.with_name(manifest.name + ".sig")
    signature.write_bytes(b" " * (signing.MAX_SIGNATURE_BYTES + 1))
    with pytest.raises(ManifestSignatureInvalid, match="larger than"):
        ManifestVerifier(public).load_manifest(str(manifest), version="v2")
    signature.unlink()
    signature.mkdir()
    with pytest.raises(ManifestSignatureInvalid, match="no readable signature"):
        ManifestVerifier(public).load_manifest(str(manifest), version="v2")


@pytest.mark.parametrize("signed_version", ["v1", None])
def test_a_validly_signed_manifest_of_another_version_is_refused(
    tmp_path: Path, keys: tuple[Path, Path], signed_version: str | None
) -> None:
    """A signature binds content, not a request: an older signed manifest replayed under
    another version (or one that names none) is not loaded."""
    private, public = keys
    ckpt = tmp_path / "old"
    ckpt.mkdir()
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(ckpt / "model.safetensors"))
    path = ckpt / mf.DEFAULT_MANIFEST_NAME
    mf.write_manifest(mf.build_manifest(ckpt, version=signed_version), path)
    sign(path, private)

    with pytest.raises(ManifestSignatureInvalid, match="validly signed, but for version"):
        ManifestVerifier(public).load_manifest(str(path), version="v2")


def test_the_verified_bytes_are_the_parsed_bytes(
    manifest: Path, keys: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A manifest replaced on the volume right after the signature check is never parsed: the
    file is read once, the copy verified is private, and the same bytes are parsed."""
    private, public = keys
    sign(manifest, private)
    original = manifest.read_bytes()
    ckpt = tmp_path / "swap"
    ckpt.mkdir()
    save_file({"w": np.ones((2, 2), dtype=np.float32)}, str(ckpt / "model.safetensors"))
    other = mf.manifest_bytes(mf.build_manifest(ckpt, version="v2"))
    verify = ManifestVerifier.check

    def check_then_swap(self: ManifestVerifier, raw: bytes, path: str) -> None:
        verify(self, raw, path)
        manifest.write_bytes(other)  # the volume writer, one instant too late

    monkeypatch.setattr(ManifestVerifier, "check", check_then_swap)
    loaded, pin = ManifestVerifier(public).load_manifest(str(manifest), version="v2")

    assert pin == mf.manifest_file_digest(original)
    assert loaded.digest == mf.Manifest.model_validate(json.loads(original)).digest
    assert manifest.read_bytes() == other


def test_load_accepts_an_ec_public_key_only(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    private, public = keys
    assert ManifestVerifier.load(public).public_key == public
    rsa_key = tmp_path / "rsa.pub"
    rsa_key.write_bytes(
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a key\n")
    for bad in (private, rsa_key, garbage):
        with pytest.raises(SigningUnavailable, match="is not an elliptic-curve public key") as e:
            ManifestVerifier.load(bad)
        assert "--manifest-public-key (WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY)" in str(e.value)
    with pytest.raises(SigningUnavailable, match="cannot read"):
        ManifestVerifier.load(tmp_path / "missing.pem")


def test_load_names_the_missing_package(
    keys: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.import_module

    def without_model_signing(name: str, package: str | None = None) -> ModuleType:
        if name.startswith("model_signing"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_model_signing)
    with pytest.raises(SigningUnavailable, match=r"needs the model-signing package"):
        ManifestVerifier.load(keys[1])


def test_the_sidecar_imports_model_signing_only_when_configured() -> None:
    """Importing the agent never imports model_signing (it starts without the package)."""
    import subprocess
    import sys

    code = (
        "import sys, engine_agent.sidecar.main; "
        "assert not any(m.startswith('model_signing') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
