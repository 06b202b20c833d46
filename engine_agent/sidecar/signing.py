"""Signed manifests: the agent loads a manifest only if its holder of the signing key signed it.

A manifest pin (``source.manifestDigest``) makes the WeightUpdate's author vouch for the
manifest; a signature makes whoever holds a private key vouch for it, without anyone copying
digests into WeightUpdates. With ``--manifest-public-key FILE`` (an EC public key in PEM) every
update must name ``source.manifest``, and ``<manifest>.sig`` beside it must be an OpenSSF
model-signing bundle (``model_signing sign key <manifest> --private_key KEY --signature
<manifest>.sig``) that verifies against the key, over exactly the bytes the agent read once and
then parses: they are written to a private temporary file and verified there, so a manifest
replaced on the volume between the check and the parse cannot slip through. The signed
manifest's own ``version`` must be the update's: a signature binds content, not a file name or
a request, so an older, validly signed manifest cannot be replayed under another version.
Anything else fails the update ``manifest_signature_invalid`` before the drain.

Key mode only: it is offline (sigstore's keyless mode fetches its trust root over the network).
``model_signing`` is imported lazily, so the sidecar starts without it while the setting is unset.
"""

from __future__ import annotations

import importlib
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Final

from engine_agent.manifest import Manifest, ManifestError, load_manifest, manifest_file_digest
from engine_agent.protocol import SourceSpec

__all__ = [
    "SETTING",
    "SIGNATURE_SUFFIX",
    "ManifestSignatureInvalid",
    "ManifestVerifier",
    "SigningUnavailable",
    "signature_source",
    "unsigned_update",
]

#: How messages name the setting.
SETTING: Final = "--manifest-public-key (WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY)"
#: The signature of ``<manifest>`` is ``<manifest>.sig``.
SIGNATURE_SUFFIX: Final = ".sig"
#: A model-signing bundle over one file is a few KiB; anything far larger is refused unread.
MAX_SIGNATURE_BYTES: Final = 1 << 20
#: How much of model_signing's own explanation a failure quotes.
_REASON_CHARS: Final = 200


class SigningUnavailable(ValueError):
    """The setting cannot be used: model_signing is missing or the key is not a usable public
    key (the agent stops at start, exit 2)."""


class ManifestSignatureInvalid(ManifestError):
    """The manifest is unsigned, not signed by the configured key, or signed for another version."""

    code = "manifest_signature_invalid"


def unsigned_update(public_key: Path) -> ManifestSignatureInvalid:
    """The failure of an update that names no manifest while a key is configured."""
    return ManifestSignatureInvalid(
        f"the update names no source.manifest, but {SETTING} {str(public_key)!r} requires a "
        "signed manifest for every update; nothing was loaded"
    )


def signature_source(source: SourceSpec) -> SourceSpec:
    """``source`` with its manifest replaced by the manifest's signature (to confine that path
    like the manifest's)."""
    return source.model_copy(update={"manifest": f"{source.manifest}{SIGNATURE_SUFFIX}"})


def _model_signing() -> ModuleType:
    try:
        return importlib.import_module("model_signing.verifying")
    except ImportError as e:
        raise SigningUnavailable(
            f"{SETTING} needs the model-signing package (pip install 'weightroll[signing]'), "
            f"which cannot be imported: {e}"
        ) from e


def _read_signature(path: Path) -> bytes:
    """The bundle's bytes: a regular file, at most :data:`MAX_SIGNATURE_BYTES`."""
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{str(path)!r} is not a regular file")
        raw = handle.read(MAX_SIGNATURE_BYTES + 1)
    if len(raw) > MAX_SIGNATURE_BYTES:
        raise OSError(f"{str(path)!r} is larger than {MAX_SIGNATURE_BYTES} bytes")
    return raw


@dataclass(frozen=True, slots=True)
class ManifestVerifier:
    """Verifies manifests against the public key in :attr:`public_key` (re-read per update, so
    a rotated key file takes effect without a restart)."""

    public_key: Path

    @classmethod
    def load(cls, public_key: Path) -> ManifestVerifier:
        """Check at start-up that model_signing imports and ``public_key`` is a key it accepts.

        Raises:
            SigningUnavailable: naming the setting and the file.
        """
        verifying = _model_signing()
        try:
            verifying.Config().use_elliptic_key_verifier(public_key=public_key)
        except OSError as e:
            raise SigningUnavailable(
                f"{SETTING}: cannot read {str(public_key)!r}: {e.strerror or e}"
            ) from e
        except Exception as e:  # cryptography: ValueError, TypeError, UnsupportedAlgorithm
            raise SigningUnavailable(
                f"{SETTING}: {str(public_key)!r} is not an elliptic-curve public key in PEM "
                f"(P-256, P-384 or P-521) that model signing accepts: {e}"
            ) from e
        return cls(public_key)

    def check(self, raw: bytes, manifest: str) -> None:
        """Verify ``<manifest>.sig`` over ``raw`` (the manifest's bytes as read once).

        Raises:
            ManifestSignatureInvalid: no readable signature, or it does not verify.
        """
        signature = Path(manifest + SIGNATURE_SUFFIX)
        try:
            bundle = _read_signature(signature)
        except OSError as e:
            raise ManifestSignatureInvalid(
                f"manifest {manifest!r} has no readable signature {str(signature)!r} "
                f"({e.strerror or e}), but {SETTING} requires every manifest to be signed; "
                "nothing was loaded"
            ) from e
        try:
            verifying = _model_signing()
            # A private directory: nobody else can swap the copy between write and verify.
            with tempfile.TemporaryDirectory(prefix="weightroll-manifest-") as private:
                copy, sig = Path(private, "manifest.json"), Path(private, "manifest.sig")
                copy.write_bytes(raw)
                sig.write_bytes(bundle)
                # A fresh config per check: verify() caches the hashing config it guessed.
                config = verifying.Config().use_elliptic_key_verifier(public_key=self.public_key)
                config.verify(copy, sig)
        except Exception as e:  # model_signing: ValueError, protobuf/JSON errors, OSError
            reason = " ".join(str(e).split())[:_REASON_CHARS] or type(e).__name__
            raise ManifestSignatureInvalid(
                f"manifest {manifest!r} is not signed by the key of {SETTING} "
                f"{str(self.public_key)!r} (signature {str(signature)!r}: {reason}); "
                "nothing was loaded"
            ) from e

    def load_manifest(
        self, path: str, *, version: str, pinned: str | None = None
    ) -> tuple[Manifest, str]:
        """Read ``path`` once, check the pin and the signature over those bytes, parse them,
        and require the signed ``version`` to be the update's.

        Returns:
            The manifest and the pin of the verified bytes (``sha256:<hex>``), which the ranks
            check against the file they read themselves.

        Raises:
            ManifestSignatureInvalid: unsigned, signed by another key, or for another version.
            ManifestError: unreadable, a pin mismatch, or invalid.
        """
        verified: list[str] = []

        def check(raw: bytes) -> None:
            self.check(raw, path)
            verified.append(manifest_file_digest(raw))

        manifest = load_manifest(path, pinned=pinned, check=check)
        if manifest.version != version:
            raise ManifestSignatureInvalid(
                f"manifest {path!r} is validly signed, but for version {manifest.version} and "
                f"this update is to {version}: with {SETTING} a manifest is loaded only for the "
                "version it was signed for; nothing was loaded"
            )
        return manifest, verified[0]
