"""The manifest file on disk: read once and checked against its pin, written atomically.

A manifest is read once (:func:`load_manifest`): the bytes hashed against the pin
(:func:`manifest_file_digest`, ``spec.source.manifestDigest``) and given to the sidecar's
signature check are the bytes parsed, so a manifest replaced between a check and a read cannot
slip through. Only regular files are opened (:func:`require_regular_file`, which the checkpoint
reader in :mod:`.build` uses too): a FIFO would block the reader. What the parsed document must
satisfy is :mod:`.format`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from engine_agent.manifest.format import (
    Manifest,
    ManifestDigestMismatch,
    ManifestError,
    ManifestMismatch,
)

__all__ = [
    "load_manifest",
    "manifest_bytes",
    "manifest_file_digest",
    "require_regular_file",
    "write_manifest",
]


def manifest_file_digest(raw: bytes) -> str:
    """The pin of a manifest file: ``sha256:`` and the hex SHA-256 of its exact bytes.

    This is what ``spec.source.manifestDigest`` holds and what ``weightroll manifest`` prints.
    Unlike :attr:`Manifest.digest` (over the ``tensors`` map only) it covers every byte of the
    file, ``version`` and ``baseVersion`` included.
    """
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def manifest_bytes(manifest: Manifest) -> bytes:
    """The exact bytes :func:`write_manifest` writes (indented JSON and a final newline)."""
    return (json.dumps(manifest.to_json(), indent=2, sort_keys=False) + "\n").encode()


def load_manifest(
    path: str | os.PathLike[str],
    *,
    pinned: str | None = None,
    check: Callable[[bytes], None] | None = None,
) -> Manifest:
    """Read and validate a manifest file; with ``pinned`` or ``check``, check its bytes first.

    The file is read once: the bytes hashed against ``pinned`` (and given to ``check``) are the
    bytes parsed, so a manifest replaced between a check and a read cannot slip through.

    Args:
        path: the manifest file.
        pinned: ``sha256:<hex>`` the file must hash to (:func:`manifest_file_digest`); the
            update's ``source.manifestDigest``.
        check: called with the bytes after the pin, before parsing (the sidecar's signature
            check); what it raises propagates.

    Raises:
        ManifestDigestMismatch: the bytes do not hash to ``pinned`` (checked before parsing).
        ManifestError: the file is missing or unreadable, is not JSON, or does not validate
            (wrong format, bad entry, wrong total, digest mismatch); the message names the file
            and the problem.
    """
    path = Path(path)
    require_regular_file(path, "manifest")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"cannot read manifest {str(path)!r}: {e.strerror or e}") from e
    if pinned is not None:
        actual = manifest_file_digest(raw)
        if actual != pinned:
            raise ManifestDigestMismatch(
                f"manifest {str(path)!r} hashes to {actual}, but source.manifestDigest "
                f"(spec.source.manifestDigest of the WeightUpdate) pins {pinned}: the manifest "
                "is not the one the update was written for; nothing was loaded"
            )
    if check is not None:
        check(raw)
    try:
        document = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"manifest {str(path)!r} is not valid JSON: {e}") from e
    try:
        return Manifest.model_validate(document)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or '<root>'}: {err['msg']}"
            for err in e.errors()
        )
        error = ManifestError(f"manifest {str(path)!r} is invalid: {problems}")
        if any("digest mismatch" in err["msg"] for err in e.errors()):
            error = ManifestMismatch(f"manifest {str(path)!r} is invalid: {problems}")
        raise error from e


def write_manifest(manifest: Manifest, path: str | os.PathLike[str]) -> str:
    """Write ``manifest`` to ``path`` (indented JSON) atomically via a temporary sibling file.

    Returns:
        The pin of the bytes written (:func:`manifest_file_digest`).
    """
    path = Path(path)
    raw = manifest_bytes(manifest)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return manifest_file_digest(raw)


def require_regular_file(path: Path, what: str) -> None:
    """Refuse ``path`` unless it is a regular file (symlinks followed), without opening it.

    Opening a FIFO blocks until something writes to it, and a device or socket is no
    checkpoint: one such name in a checkpoint directory would hang the reader (issue 26, 8).

    Raises:
        ManifestError: naming the file and what it is.
    """
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise ManifestError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from e
    if not stat.S_ISREG(mode):
        kind = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "not a regular file"
        if stat.S_ISDIR(mode):
            kind = "a directory"
        raise ManifestError(
            f"{what} {str(path)!r} is {kind}; only regular files are read (it was not opened)"
        )
