"""Key pairs and model-signing bundles for the signed-manifest tests (generated at test time).

The publisher's side of ``--manifest-public-key``: an EC P-256 key pair (model-signing's key
mode) and ``model_signing sign key <manifest> --private_key KEY --signature <manifest>.sig``
through its Python API. Needs the ``signing`` extra.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

__all__ = ["sign", "write_key_pair"]


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``<name>.key`` (private, PKCS#8 PEM) and ``<name>.pub`` (public PEM); return both."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


def sign(manifest: Path, private_key: Path) -> Path:
    """Sign ``manifest`` with ``private_key`` into ``<manifest>.sig``; return its path."""
    # the signing extra; imported only by the tests that sign (untyped: through importlib)
    signing = importlib.import_module("model_signing.signing")
    signature = manifest.with_name(manifest.name + ".sig")
    signing.Config().use_elliptic_key_signer(private_key=private_key).sign(manifest, signature)
    return signature
