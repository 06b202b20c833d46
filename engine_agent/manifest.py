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

Format (JSON, ``weightroll.manifest/v2``; ``v1`` is still read)::

    {"format": "weightroll.manifest/v2", "version": "v2" | null, "baseVersion": "v1" | null,
     "tensors": {"<name>": {"file": "model-00001-of-00002.safetensors", "dtype": "BF16",
                            "shape": [512, 128], "nbytes": 131072, "blake3": "<hex>"}},
     "totalBytes": 131072, "digest": "<hex>"}

Versions: ``v2`` entries carry ``blake3`` (BLAKE3, 32-byte hex), ``v1`` entries ``sha256``; a
manifest uses one algorithm for every entry, and a rank verifies with the algorithm the manifest
names. ``weightroll manifest`` writes ``v2`` unless ``--hash sha256`` is given.

Invariants:
    * ``blake3`` / ``sha256`` is over the tensor's raw bytes exactly as stored in the file
      (little-endian, row-major, the safetensors layout); no dtype conversion happens anywhere.
    * ``digest`` is SHA-256 (in both versions) over the canonical JSON of ``tensors`` — keys
      sorted, separators ``,`` and ``:`` (no spaces), ASCII-escaped — so any edit of any entry
      changes it.
      :func:`load_manifest` recomputes it and refuses a manifest whose digest does not match.
    * ``totalBytes`` is the sum of every entry's ``nbytes``; ``nbytes`` matches ``dtype`` and
      ``shape`` for every whole-byte dtype.
    * A delta or sparse checkpoint names the version it applies to in ``baseVersion``.
    * Building a manifest streams every file in chunks of :data:`CHUNK_BYTES`; a checkpoint is
      never loaded into memory whole. Only the safetensors header is parsed (8-byte little-endian
      length, then a JSON header with ``data_offsets`` relative to the end of the header).

This module imports neither torch nor vLLM: the sidecar, the operator-side CLI and the in-rank
extension all use it.

Limitations:
    * Only ``*.safetensors`` files directly inside the directory are covered (no recursion) —
      with a ``model.safetensors.index.json``, exactly the files its ``weight_map`` lists (as
      vLLM reads them, see :func:`checkpoint_files`); other files (config, tokenizer) are not
      part of the manifest.
    * Sub-byte dtypes (``F4``, ``F6_*``) are accepted but their ``nbytes`` is not cross-checked
      against ``shape``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import stat
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Final, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from engine_agent.protocol import VERSION_PATTERN

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

#: ``format`` of manifests whose entries carry ``sha256`` (still accepted).
FORMAT_V1: Final = "weightroll.manifest/v1"
#: ``format`` of manifests whose entries carry ``blake3``; what this module writes by default.
FORMAT_V2: Final = "weightroll.manifest/v2"
#: Value of the ``format`` field written by default; bump the suffix on any incompatible change.
FORMAT: Final = FORMAT_V2
HashAlgorithm = Literal["blake3", "sha256"]
#: Content-hash algorithm of each format.
FORMAT_ALGORITHM: Final[dict[str, HashAlgorithm]] = {FORMAT_V1: "sha256", FORMAT_V2: "blake3"}
#: The sharded-checkpoint index vLLM and transformers follow.
INDEX_NAME: Final = "model.safetensors.index.json"
#: File name ``weightroll manifest DIR`` writes inside DIR when ``--out`` is not given.
DEFAULT_MANIFEST_NAME: Final = "weightroll-manifest.json"
#: Read size while hashing; large enough to keep hashlib busy, small enough to never matter.
CHUNK_BYTES: Final = 8 * 1024 * 1024
#: safetensors refuses headers above 100 MB; so do we (a corrupt length would otherwise
#: make us allocate gigabytes).
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
#: Bytes per element of every whole-byte safetensors dtype.
DTYPE_SIZES: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "C64": 8,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
#: Dtypes safetensors knows whose elements are smaller than a byte.
SUB_BYTE_DTYPES: Final = frozenset({"F4", "F6_E2M3", "F6_E3M2"})

_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """A manifest or checkpoint that cannot be used; the message names the file and the problem.

    Attributes:
        code: machine-readable reason, used as ``ErrorBody.code`` and as a metric label.
    """

    code: str = "manifest_invalid"


class ManifestMismatch(ManifestError):
    """Bytes (or dtype, shape, size) that differ from what the manifest pins."""

    code = "manifest_mismatch"


class ManifestDigestMismatch(ManifestError):
    """The manifest file's bytes differ from the ``manifestDigest`` the update pins."""

    code = "manifest_digest_mismatch"


class _ManifestModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


class TensorEntry(_ManifestModel):
    """What the manifest pins for one tensor."""

    #: File that holds the tensor, relative to the checkpoint directory (a plain file name).
    file: str = Field(min_length=1)
    #: safetensors dtype string, e.g. ``"BF16"``.
    dtype: str
    #: Shape as stored in the file.
    shape: tuple[int, ...]
    #: Size of the stored bytes.
    nbytes: int = Field(ge=0)
    #: Lower-case hex SHA-256 of the stored bytes (``weightroll.manifest/v1``).
    sha256: str | None = None
    #: Lower-case hex BLAKE3 of the stored bytes (``weightroll.manifest/v2``).
    blake3: str | None = None

    @field_validator("file")
    @classmethod
    def _relative_file(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts or "\\" in value:
            raise ValueError(f"file must be relative to the checkpoint directory, got {value!r}")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPE_SIZES and value not in SUB_BYTE_DTYPES:
            raise ValueError(f"unknown safetensors dtype {value!r}")
        return value

    @field_validator("shape")
    @classmethod
    def _non_negative_shape(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(dim < 0 for dim in value):
            raise ValueError(f"shape dimensions must be >= 0, got {list(value)}")
        return value

    @field_validator("sha256", "blake3")
    @classmethod
    def _hex_digest(cls, value: str | None) -> str | None:
        if value is not None and not _HEX64_RE.match(value):
            raise ValueError("sha256 and blake3 must be 64 lower-case hex digits")
        return value

    @property
    def algorithm(self) -> HashAlgorithm:
        return "blake3" if self.blake3 is not None else "sha256"

    @property
    def content_hash(self) -> str:
        value = self.blake3 if self.blake3 is not None else self.sha256
        assert value is not None
        return value

    @model_validator(mode="after")
    def _size_matches_shape(self) -> Self:
        if (self.sha256 is None) == (self.blake3 is None):
            raise ValueError("an entry carries exactly one of sha256 (v1) and blake3 (v2)")
        itemsize = DTYPE_SIZES.get(self.dtype)
        if itemsize is not None and self.nbytes != math.prod(self.shape) * itemsize:
            raise ValueError(
                f"nbytes {self.nbytes} does not match dtype {self.dtype} and shape "
                f"{list(self.shape)} ({math.prod(self.shape) * itemsize} bytes)"
            )
        return self

    def to_json(self) -> dict[str, Any]:
        """Return the entry as written in the manifest (shape as a list)."""
        return {
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            self.algorithm: self.content_hash,
        }


def canonical_tensors_json(tensors: dict[str, TensorEntry]) -> str:
    """Return the canonical JSON of a ``tensors`` map: sorted keys, no spaces, ASCII only."""
    plain = {name: entry.to_json() for name, entry in tensors.items()}
    return json.dumps(plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def tensors_digest(tensors: dict[str, TensorEntry]) -> str:
    """Return the manifest digest: SHA-256 hex over :func:`canonical_tensors_json`."""
    return hashlib.sha256(canonical_tensors_json(tensors).encode("ascii")).hexdigest()


class Manifest(_ManifestModel):
    """A validated checkpoint manifest; construction checks the total and the digest."""

    format: Literal["weightroll.manifest/v1", "weightroll.manifest/v2"] = FORMAT
    #: Weight version this checkpoint is (optional; the sidecar checks it against the request).
    version: str | None = Field(default=None, pattern=VERSION_PATTERN)
    #: For delta or sparse checkpoints: the version the patch applies to.
    base_version: str | None = Field(default=None, pattern=VERSION_PATTERN)
    tensors: dict[str, TensorEntry]
    total_bytes: int = Field(ge=0)
    #: SHA-256 hex over the canonical JSON of ``tensors``.
    digest: str

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        algorithm = FORMAT_ALGORITHM[self.format]
        wrong = sorted(n for n, e in self.tensors.items() if e.algorithm != algorithm)
        if wrong:
            raise ValueError(
                f"{self.format} entries carry {algorithm}, but {wrong[0]!r} carries "
                f"{self.tensors[wrong[0]].algorithm}"
            )
        total = sum(entry.nbytes for entry in self.tensors.values())
        if total != self.total_bytes:
            raise ValueError(f"totalBytes is {self.total_bytes} but the tensors sum to {total}")
        expected = tensors_digest(self.tensors)
        if self.digest != expected:
            raise ValueError(
                f"digest mismatch: the manifest says {self.digest!r} but its tensors hash to "
                f"{expected!r}; the manifest was edited or corrupted"
            )
        return self

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, TensorEntry],
        *,
        version: str | None = None,
        base_version: str | None = None,
    ) -> Manifest:
        """Build a manifest from entries, computing ``totalBytes`` and ``digest``.

        The format follows the entries' algorithm (``sha256`` → v1, ``blake3`` → v2).
        """
        sha = any(entry.algorithm == "sha256" for entry in tensors.values())
        return cls(
            format=FORMAT_V1 if sha else FORMAT_V2,
            version=version,
            base_version=base_version,
            tensors=tensors,
            total_bytes=sum(entry.nbytes for entry in tensors.values()),
            digest=tensors_digest(tensors),
        )

    def entry(self, name: str) -> TensorEntry | None:
        """Return the entry of tensor ``name``, or ``None`` if the manifest does not list it."""
        return self.tensors.get(name)

    @property
    def algorithm(self) -> HashAlgorithm:
        """The content-hash algorithm of every entry (``blake3`` for v2, ``sha256`` for v1)."""
        return FORMAT_ALGORITHM[self.format]

    def rank_digest(self) -> str:
        """The ``digest`` a rank reports after reading every tensor of this manifest."""
        return rank_digest({name: entry.content_hash for name, entry in self.tensors.items()})

    def files(self) -> list[str]:
        """Return the distinct file names the manifest refers to, sorted."""
        return sorted({entry.file for entry in self.tensors.values()})

    def verify(
        self,
        name: str,
        data: Any,
        *,
        dtype: str | None = None,
        shape: Sequence[int] | None = None,
    ) -> TensorEntry:
        """Check one tensor's stored bytes (and optionally dtype and shape) against the manifest.

        Args:
            name: checkpoint tensor name.
            data: the raw bytes as stored in the file; any C-contiguous buffer.
            dtype: the safetensors dtype string the reader saw, if known.
            shape: the shape the reader saw, if known.

        Returns:
            The matching entry.

        Raises:
            ManifestMismatch: the tensor is not listed, or dtype, shape, size or hash differ.
        """
        view = memoryview(data)
        entry = self.check_header(name, dtype=dtype, shape=shape, nbytes=view.nbytes)
        self.check_hash(name, content_hash(view, self.algorithm))
        return entry

    def check_header(
        self,
        name: str,
        *,
        dtype: str | None = None,
        shape: Sequence[int] | None = None,
        nbytes: int | None = None,
        file: str | None = None,
    ) -> TensorEntry:
        """Check what a reader knows before reading the bytes: listed, file, dtype, shape, size.

        Raises:
            ManifestMismatch: naming the tensor and what differs.
        """
        entry = self.tensors.get(name)
        if entry is None:
            raise ManifestMismatch(f"tensor {name!r} is not listed in the manifest")
        if file is not None and file != entry.file:
            raise ManifestMismatch(
                f"tensor {name!r} is read from {file} but the manifest pins it in {entry.file}"
            )
        if dtype is not None and dtype != entry.dtype:
            raise ManifestMismatch(
                f"tensor {name!r}: dtype {dtype} but the manifest says {entry.dtype}"
            )
        if shape is not None and tuple(shape) != entry.shape:
            raise ManifestMismatch(
                f"tensor {name!r}: shape {list(shape)} but the manifest says {list(entry.shape)}"
            )
        if nbytes is not None and nbytes != entry.nbytes:
            raise ManifestMismatch(
                f"tensor {name!r}: {nbytes} bytes but the manifest says {entry.nbytes}"
            )
        return entry

    def check_hash(self, name: str, actual: str) -> None:
        """Compare the content hash (in :attr:`algorithm`) of tensor ``name``'s stored bytes.

        Raises:
            ManifestMismatch: not listed, or the hash differs.
        """
        entry = self.tensors.get(name)
        if entry is None:
            raise ManifestMismatch(f"tensor {name!r} is not listed in the manifest")
        if actual != entry.content_hash:
            raise ManifestMismatch(
                f"tensor {name!r}: {self.algorithm} {actual} but the manifest says "
                f"{entry.content_hash}; the bytes read are not the bytes the manifest pins"
            )

    def to_json(self) -> dict[str, Any]:
        """Return the manifest as written to disk (camelCase keys, tensors sorted by name)."""
        return {
            "format": self.format,
            "version": self.version,
            "baseVersion": self.base_version,
            "tensors": {name: self.tensors[name].to_json() for name in sorted(self.tensors)},
            "totalBytes": self.total_bytes,
            "digest": self.digest,
        }


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
    consumed (``engine_agent/protocol.py``, ``RankReport.digest``); with a manifest every rank
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


def read_safetensors_header(handle: BinaryIO, file_name: str) -> tuple[int, dict[str, Any]]:
    """Parse the header of an open safetensors file.

    Returns:
        ``(data_start, tensors)``: the byte offset of the data section and the header's tensor
        entries (``__metadata__`` removed).

    Raises:
        ManifestError: the header is truncated, too large or not a JSON object.
    """
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise ManifestError(f"{file_name}: truncated safetensors file (no header length)")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES:
        raise ManifestError(f"{file_name}: safetensors header length {length} is implausible")
    raw = handle.read(length)
    if len(raw) != length:
        raise ManifestError(f"{file_name}: truncated safetensors header")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{file_name}: safetensors header is not JSON: {e}") from e
    if not isinstance(header, dict):
        raise ManifestError(f"{file_name}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return 8 + length, header


def _hash_range(handle: BinaryIO, start: int, nbytes: int, algorithm: HashAlgorithm) -> str:
    digest = new_hasher(algorithm)
    handle.seek(start)
    left = nbytes
    while left > 0:
        chunk = handle.read(min(CHUNK_BYTES, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    if left:
        raise ManifestError("truncated tensor data")
    return str(digest.hexdigest())


def _first_offset(info: Any) -> int:
    try:
        return int(info["data_offsets"][0])
    except (KeyError, TypeError, ValueError, IndexError):
        return 0


def _file_entries(path: Path, algorithm: HashAlgorithm) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    size = path.stat().st_size
    with path.open("rb") as handle:
        data_start, header = read_safetensors_header(handle, path.name)
        # Hash in file order so reads are sequential.
        items = sorted(
            header.items(),
            key=lambda item: (
                item[1].get("data_offsets", [0])[0] if isinstance(item[1], dict) else 0
            ),
        )
        for name, info in items:
            try:
                dtype = info["dtype"]
                shape = [int(dim) for dim in info["shape"]]
                begin, end = (int(offset) for offset in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ManifestError(f"{path.name}: malformed header entry for {name!r}") from e
            if not 0 <= begin <= end or data_start + end > size:
                raise ManifestError(
                    f"{path.name}: tensor {name!r} data_offsets [{begin}, {end}] lie outside "
                    f"the file (truncated?)"
                )
            try:
                sha = _hash_range(handle, data_start + begin, end - begin, algorithm)
            except ManifestError as e:
                raise ManifestError(f"{path.name}: tensor {name!r}: {e}") from e
            try:
                entries[name] = TensorEntry.model_validate(
                    {
                        "file": path.name,
                        "dtype": dtype,
                        "shape": tuple(shape),
                        "nbytes": end - begin,
                        algorithm: sha,
                    }
                )
            except ValidationError as e:
                raise ManifestError(f"{path.name}: tensor {name!r}: {e.errors()[0]['msg']}") from e
    return entries


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


def checkpoint_files(root: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint, chosen the way vLLM's loader chooses them.

    A directory with ``model.safetensors.index.json`` is exactly the files its ``weight_map``
    lists (stale shards next to them are ignored, as vLLM ignores them); without one, every
    ``*.safetensors`` file directly inside it. A file is itself.

    Returns:
        ``(files, weight_map)``: sorted files, and the index's name → file map (``None``
        without an index).

    Raises:
        ManifestError: the path is missing, has no safetensors file, the index is unreadable or
            names a file that is missing or outside the directory, or a file it would read is
            not a regular file (a FIFO, a device: named, never opened).
    """
    if root.is_file():
        return [root], None
    if not root.is_dir():
        if root.exists():
            require_regular_file(root, "checkpoint")
        raise ManifestError(f"checkpoint {str(root)!r} does not exist")
    index_path = root / INDEX_NAME
    if not index_path.exists():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ManifestError(f"no *.safetensors files in {str(root)!r}")
        for file in files:
            require_regular_file(file, "checkpoint file")
        return files, None
    require_regular_file(index_path, "checkpoint index")
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("weight_map is not a map of tensor name to file name")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{index_path} is not a usable safetensors index: {e}") from e
    files = []
    for file_name in sorted(set(weight_map.values())):
        path = PurePosixPath(file_name)
        if path.is_absolute() or len(path.parts) != 1:
            raise ManifestError(f"{index_path} names {file_name!r}, which is not a file in {root}")
        if not (root / file_name).exists():
            raise ManifestError(f"{index_path} lists {file_name}, which does not exist in {root}")
        require_regular_file(root / file_name, "checkpoint file")
        files.append(root / file_name)
    if not files:
        raise ManifestError(f"{index_path} lists no files")
    return files, weight_map


def index_conflicts(
    weight_map: dict[str, str] | None, file_name: str, names: Sequence[str]
) -> list[str]:
    """Why the tensors ``names`` found in ``file_name`` disagree with the index ([] if none)."""
    if weight_map is None:
        return []
    problems = [
        f"{file_name} holds {name!r}, which {INDEX_NAME} assigns to "
        f"{weight_map.get(name) or 'no file'}"
        for name in sorted(names)
        if weight_map.get(name) != file_name
    ]
    present = set(names)
    problems += [
        f"{INDEX_NAME} lists {name!r} in {file_name}, which does not hold it"
        for name, listed in sorted(weight_map.items())
        if listed == file_name and name not in present
    ]
    return problems


def build_manifest(
    directory: str | os.PathLike[str],
    version: str | None = None,
    base_version: str | None = None,
    *,
    algorithm: HashAlgorithm = "blake3",
) -> Manifest:
    """Hash every tensor of a safetensors checkpoint and return its manifest.

    Args:
        directory: a directory of ``*.safetensors`` files (or one such file); with a
            ``model.safetensors.index.json``, the files it lists (:func:`checkpoint_files`).
        version: the weight version this checkpoint is, if known.
        base_version: for delta/sparse checkpoints, the version they apply to.
        algorithm: ``blake3`` (format v2, the default) or ``sha256`` (format v1).

    Raises:
        ManifestError: no safetensors file, a corrupt or truncated file, a tensor name that
            appears in two files, a file that disagrees with the index, or a version that is
            not a valid label value.
    """
    for label, value in (("version", version), ("base_version", base_version)):
        if value is not None and not re.match(VERSION_PATTERN, value):
            raise ManifestError(f"{label} {value!r} is not a valid version (label-value syntax)")
    files, weight_map = checkpoint_files(Path(directory))
    tensors: dict[str, TensorEntry] = {}
    for path in files:
        entries = _file_entries(path, algorithm)
        conflicts = index_conflicts(weight_map, path.name, list(entries))
        if conflicts:
            raise ManifestError("; ".join(conflicts[:5]))
        for name, entry in entries.items():
            if name in tensors:
                raise ManifestError(
                    f"tensor {name!r} appears in both {tensors[name].file} and {entry.file}"
                )
            tensors[name] = entry
    try:
        return Manifest.from_tensors(tensors, version=version, base_version=base_version)
    except ValidationError as e:
        raise ManifestError(
            "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        ) from e


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightroll manifest",
        description=(
            "Write a JSON manifest (dtype, shape, content hash per tensor, total bytes, digest) "
            "for a safetensors checkpoint."
        ),
        epilog=(
            "Only *.safetensors files directly inside DIR are hashed (with "
            "model.safetensors.index.json: exactly the files it lists). Name the manifest in the "
            "WeightUpdate's spec.source.manifest; every rank checks the bytes it reads against "
            "it before writing a live tensor. Prints the manifest file's pin (sha256:<hex> of "
            "its exact bytes) on stdout (on stderr with --out -): put it in "
            "spec.source.manifestDigest and the agents refuse any other manifest before "
            "draining. Exit status: 0 written, 1 the checkpoint cannot be hashed or the "
            "manifest not written, 2 bad usage."
        ),
    )
    parser.add_argument("directory", metavar="DIR", help="checkpoint directory (or one file)")
    parser.add_argument(
        "--out",
        metavar="FILE",
        help=f"where to write the manifest ('-' for stdout; default DIR/{DEFAULT_MANIFEST_NAME})",
    )
    parser.add_argument("--version", metavar="V", help="weight version of this checkpoint")
    parser.add_argument(
        "--base-version", metavar="V", help="for delta/sparse checkpoints: the base version"
    )
    parser.add_argument(
        "--hash",
        choices=("blake3", "sha256"),
        default="blake3",
        help="content hash: blake3 (format v2, default) or sha256 (format v1)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``weightroll manifest DIR [--out FILE] [--version V] [--base-version V] [--hash H]``.

    Returns:
        0 on success, 1 when the checkpoint cannot be hashed, 2 on bad usage.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        manifest = build_manifest(
            args.directory, args.version, args.base_version, algorithm=args.hash
        )
    except ManifestError as e:
        root = Path(args.directory)
        bad_dir = not root.exists() or (root.is_dir() and not any(root.glob("*.safetensors")))
        hint = "; pass a directory of *.safetensors files (or one such file)" if bad_dir else ""
        print(f"weightroll manifest: {e}{hint}", file=sys.stderr)
        return 1
    if args.out == "-":
        # stdout is the manifest itself; the pin of exactly these bytes goes to stderr
        raw = manifest_bytes(manifest)
        sys.stdout.write(raw.decode("ascii"))  # json.dumps escapes to ASCII: same bytes
        sys.stdout.flush()
        print(f"manifestDigest: {manifest_file_digest(raw)}", file=sys.stderr)
        return 0
    root = Path(args.directory)
    out = Path(args.out) if args.out else (root if root.is_dir() else root.parent)
    if not args.out:
        out = out / DEFAULT_MANIFEST_NAME
    try:
        pin = write_manifest(manifest, out)
    except OSError as e:
        print(f"weightroll manifest: cannot write {str(out)!r}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(
        f"Wrote manifest for {len(manifest.tensors)} tensors ({manifest.total_bytes} bytes) to "
        f"{out}; pin it with spec.source.manifestDigest: {pin}",
        file=sys.stderr,
    )
    print(pin)  # stdout: just the pin, for DIGEST=$(weightroll manifest DIR)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
