"""Checkpoint manifests: a content hash per tensor of a safetensors checkpoint, and a digest.

A manifest pins the exact bytes of a checkpoint. ``weightroll manifest DIR`` writes one; the worker
extension loads it with :func:`load_manifest` and, before any byte reaches a live tensor, checks
what each rank read with :meth:`Manifest.verify`; the sidecar loads it too, so a corrupt, stale or
tampered manifest fails the update before generation is paused.

A manifest only vouches for itself: whoever can write the volume can rewrite checkpoint and
manifest together. ``weightroll manifest`` therefore prints the manifest file's *pin*,
``sha256:<hex>`` of its exact bytes (:func:`manifest_file_digest`); a WeightUpdate that carries
it in ``spec.source.manifestDigest`` makes the sidecar refuse any other manifest
(:class:`ManifestDigestMismatch`, checked by :func:`load_manifest` on the bytes it parses)
before draining, so before anything is written to the engine. An agent given a public key also
requires a signature over those same bytes (``engine_agent.sidecar.signing``).

Parts, lowest first (``.importlinter`` contract ``manifest-layers``):
    * :mod:`.hashing` — BLAKE3 / SHA-256 content hashes and the rank digest.
    * :mod:`.format` — the ``weightroll.manifest/v1|v2`` models, their errors and the canonical
      digest; the format and its invariants are documented there.
    * :mod:`.file` — reading the file once (with the pin) and writing it atomically.
    * :mod:`.build` — safetensors headers, the files vLLM would read, and the streaming build.
    * :mod:`.cli` — ``weightroll manifest DIR [--out FILE] [--version V] [--hash H]``.

This package is the façade every other module imports; the names below are its public surface.
It imports neither torch nor vLLM: the sidecar, the operator-side CLI and the in-rank extension
all use it.
"""

from engine_agent.manifest.build import (
    CHUNK_BYTES,
    INDEX_NAME,
    build_manifest,
    checkpoint_files,
    index_conflicts,
    read_safetensors_header,
)
from engine_agent.manifest.cli import DEFAULT_MANIFEST_NAME, main
from engine_agent.manifest.file import (
    load_manifest,
    manifest_bytes,
    manifest_file_digest,
    require_regular_file,
    write_manifest,
)
from engine_agent.manifest.format import (
    DTYPE_SIZES,
    FORMAT,
    FORMAT_V1,
    FORMAT_V2,
    Manifest,
    ManifestDigestMismatch,
    ManifestError,
    ManifestMismatch,
    TensorEntry,
    canonical_tensors_json,
    tensors_digest,
)
from engine_agent.manifest.hashing import (
    HashAlgorithm,
    content_hash,
    new_hasher,
    rank_digest,
    sha256_hex,
)

__all__ = [
    "CHUNK_BYTES",
    "DEFAULT_MANIFEST_NAME",
    "DTYPE_SIZES",
    "FORMAT",
    "FORMAT_V1",
    "FORMAT_V2",
    "INDEX_NAME",
    "HashAlgorithm",
    "Manifest",
    "ManifestError",
    "ManifestDigestMismatch",
    "ManifestMismatch",
    "TensorEntry",
    "build_manifest",
    "canonical_tensors_json",
    "checkpoint_files",
    "index_conflicts",
    "content_hash",
    "load_manifest",
    "manifest_bytes",
    "manifest_file_digest",
    "main",
    "new_hasher",
    "rank_digest",
    "read_safetensors_header",
    "require_regular_file",
    "sha256_hex",
    "tensors_digest",
    "write_manifest",
]
