"""The manifest format: its models, its invariants and its errors.

Format (JSON, ``weightroll.manifest/v2``; ``v1`` is still read)::

    {"format": "weightroll.manifest/v2", "version": "v2" | null, "baseVersion": "v1" | null,
     "tensors": {"<name>": {"file": "model-00001-of-00002.safetensors", "dtype": "BF16",
                            "shape": [512, 128], "nbytes": 131072, "blake3": "<hex>"}},
     "totalBytes": 131072, "digest": "<hex>"}

Versions: ``v2`` entries carry ``blake3`` (BLAKE3, 32-byte hex), ``v1`` entries ``sha256``; a
manifest uses one algorithm for every entry, and a rank verifies with the algorithm the manifest
names (:data:`FORMAT_ALGORITHM`).

Invariants:
    * ``blake3`` / ``sha256`` is over the tensor's raw bytes exactly as stored in the file
      (little-endian, row-major, the safetensors layout); no dtype conversion happens anywhere.
    * ``digest`` is SHA-256 (in both versions) over the canonical JSON of ``tensors`` — keys
      sorted, separators ``,`` and ``:`` (no spaces), ASCII-escaped — so any edit of any entry
      changes it. :func:`~engine_agent.manifest.file.load_manifest` recomputes it and refuses a
      manifest whose digest does not match.
    * ``totalBytes`` is the sum of every entry's ``nbytes``; ``nbytes`` matches ``dtype`` and
      ``shape`` for every whole-byte dtype.
    * A delta or sparse checkpoint names the version it applies to in ``baseVersion``.
    * The pin (:func:`~engine_agent.manifest.file.manifest_file_digest`) is over the file's
      exact bytes, and :func:`~engine_agent.manifest.file.load_manifest` checks it on the bytes
      it parses (read once).

Reading and writing the file is :mod:`.file`; this module is what a manifest is.

Limitations:
    * Sub-byte dtypes (``F4``, ``F6_*``) are accepted but their ``nbytes`` is not cross-checked
      against ``shape``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any, Final, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from engine_agent.manifest.hashing import HashAlgorithm, content_hash, rank_digest
from engine_agent.protocol import VERSION_PATTERN

__all__ = [
    "DTYPE_SIZES",
    "FORMAT",
    "FORMAT_ALGORITHM",
    "FORMAT_V1",
    "FORMAT_V2",
    "SUB_BYTE_DTYPES",
    "Manifest",
    "ManifestDigestMismatch",
    "ManifestError",
    "ManifestMismatch",
    "TensorEntry",
    "canonical_tensors_json",
    "tensors_digest",
]

#: ``format`` of manifests whose entries carry ``sha256`` (still accepted).
FORMAT_V1: Final = "weightroll.manifest/v1"
#: ``format`` of manifests whose entries carry ``blake3``; what this module writes by default.
FORMAT_V2: Final = "weightroll.manifest/v2"
#: Value of the ``format`` field written by default; bump the suffix on any incompatible change.
FORMAT: Final = FORMAT_V2
#: Content-hash algorithm of each format.
FORMAT_ALGORITHM: Final[dict[str, HashAlgorithm]] = {FORMAT_V1: "sha256", FORMAT_V2: "blake3"}
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
