"""Building a manifest: reading safetensors headers and streaming every tensor through a hash.

:func:`build_manifest` is what ``weightroll manifest DIR`` runs; :func:`checkpoint_files`,
:func:`index_conflicts` and :func:`read_safetensors_header` are shared with the in-rank reader
(``engine_agent.reload.sources``), so a manifest covers exactly the files and tensors vLLM loads.

Invariants:
    * Building a manifest streams every file in chunks of :data:`CHUNK_BYTES`; a checkpoint is
      never loaded into memory whole. Only the safetensors header is parsed (8-byte little-endian
      length, then a JSON header with ``data_offsets`` relative to the end of the header).
    * Files are chosen the way vLLM's loader chooses them (:func:`checkpoint_files`), and only
      regular files are opened.

Limitations:
    * Only ``*.safetensors`` files directly inside the directory are covered (no recursion) —
      with a ``model.safetensors.index.json``, exactly the files its ``weight_map`` lists (as
      vLLM reads them, see :func:`checkpoint_files`); other files (config, tokenizer) are not
      part of the manifest.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Final

from pydantic import ValidationError

from engine_agent.manifest.file import require_regular_file
from engine_agent.manifest.format import Manifest, ManifestError, TensorEntry
from engine_agent.manifest.hashing import HashAlgorithm, new_hasher
from engine_agent.protocol import VERSION_PATTERN

__all__ = [
    "CHUNK_BYTES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "build_manifest",
    "checkpoint_files",
    "index_conflicts",
    "read_safetensors_header",
]

#: The sharded-checkpoint index vLLM and transformers follow.
INDEX_NAME: Final = "model.safetensors.index.json"
#: Read size while hashing; large enough to keep hashlib busy, small enough to never matter.
CHUNK_BYTES: Final = 8 * 1024 * 1024
#: safetensors refuses headers above 100 MB; so do we (a corrupt length would otherwise
#: make us allocate gigabytes).
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024


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
