"""Content hashes of tensor bytes, and the digest a rank folds them into.

The bottom of :mod:`engine_agent.manifest`: the format (:mod:`.format`) names an algorithm per
version and verifies with these functions, the builder (:mod:`.build`) streams files through
:func:`new_hasher`, and the in-rank digests (``engine_agent.reload.digest``) use the same
functions, so a manifest and a rank's report always hash the same way.

Invariants:
    * Hashes are over raw bytes exactly as given; no dtype conversion happens here.
    * :func:`rank_digest` is SHA-256 whatever the content hash, so v1 and v2 reports compare.

This module imports neither torch nor vLLM, nor pydantic; ``blake3`` is imported on first use.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["HashAlgorithm", "content_hash", "new_hasher", "rank_digest", "sha256_hex"]

HashAlgorithm = Literal["blake3", "sha256"]


def content_hash(buffer: Any, algorithm: HashAlgorithm = "blake3") -> str:
    """Return the lower-case hex BLAKE3 or SHA-256 of a C-contiguous buffer.

    Both ``blake3`` and ``hashlib`` release the GIL while hashing, so worker threads overlap.

    Raises:
        BufferError: the buffer is not C-contiguous.
        ValueError: unknown algorithm.
    """
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise BufferError("content_hash needs a C-contiguous buffer")
    hasher = new_hasher(algorithm)
    hasher.update(view.cast("B") if view.format != "B" else view)
    return str(hasher.hexdigest())


def new_hasher(algorithm: HashAlgorithm) -> Any:
    """An incremental hasher (``update`` / ``hexdigest``) of ``algorithm``.

    Raises:
        ValueError: unknown algorithm.
    """
    if algorithm == "blake3":
        import blake3  # installed with vLLM; a dependency of this project too

        # BLAKE3 hashes one buffer on several cores (same digest): the last tensors of a load
        # are hashed while the loaders wait, and a manifest build reads whole files.
        return blake3.blake3(max_threads=blake3.blake3.AUTO)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown hash algorithm {algorithm!r}; expected blake3 or sha256")


def rank_digest(hashes: Mapping[str, str]) -> str:
    """SHA-256 hex over ``name:hash;`` of every entry, sorted by name ("" when empty).

    A rank's ``digest`` is this over the content hashes of the checkpoint tensors its loaders
    consumed (``engine_agent/protocol/``, ``RankReport.digest``); with a manifest every rank
    that read the whole checkpoint reports :meth:`Manifest.rank_digest`.
    """
    if not hashes:
        return ""
    text = "".join(f"{name}:{value};" for name, value in sorted(hashes.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_hex(buffer: Any) -> str:
    """Return the lower-case hex SHA-256 of a C-contiguous buffer (bytes, memoryview, numpy).

    Raises:
        TypeError: ``buffer`` does not support the buffer protocol.
        BufferError: the buffer is not C-contiguous.
    """
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise BufferError("sha256_hex needs a C-contiguous buffer")
    return hashlib.sha256(view).hexdigest()
