"""Reading a safetensors file's tensors into memory the rank owns (issue 26, item 2).

Each tensor is read once from the file into a private host buffer (``torch.empty`` +
``readinto``), never a view of the page cache, so a file rewritten in place after the read
cannot change what was hashed and loaded (:func:`read_ahead`). The file's header is re-read
when the file is opened for the bytes: a tensor re-published at other offsets is read where the
header now puts it, one whose dtype or shape changed is refused (:func:`placed_now`). The
checkpoint as a whole — which files, which names, the manifest — is :mod:`.sources`.
"""

from __future__ import annotations

import io
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Final

import torch

from engine_agent.errors import SourceUnavailable

__all__ = [
    "READ_AHEAD_BYTES",
    "TensorInfo",
    "byte_ranges",
    "placed_now",
    "read_ahead",
    "safetensors_dtype",
    "torch_dtype",
]

#: Bytes read from a file ahead of the loaders, at most (one tensor more if it is larger).
READ_AHEAD_BYTES: Final = 128 << 20

_DTYPE_NAMES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def safetensors_dtype(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype))


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    file: Path
    shape: torch.Size
    dtype: torch.dtype
    #: Absolute byte offset of the tensor's data in ``file``, and its length.
    offset: int = 0
    nbytes: int = 0


def byte_ranges(file: Path, size: int) -> dict[str, tuple[int, int]]:
    """``name -> (start, end)``: absolute byte range of every tensor's data in ``file``.

    Raises:
        SourceUnavailable: the header promises more bytes than the file has.
    """
    from engine_agent.manifest import read_safetensors_header

    with file.open("rb") as handle:
        data_start, header = read_safetensors_header(handle, file.name)
    ranges = {
        name: (
            data_start + int(entry["data_offsets"][0]),
            data_start + int(entry["data_offsets"][1]),
        )
        for name, entry in header.items()
    }
    end = max((stop for _, stop in ranges.values()), default=data_start)
    if end > size:
        raise SourceUnavailable(
            f"{file} is truncated: its header promises {end} bytes, the file has {size}",
            field="path",
        )
    return ranges


def placed_now(file: Path, handle: BinaryIO, infos: list[TensorInfo]) -> list[TensorInfo]:
    """``infos`` placed where the header of the file now open puts them.

    The dry run, the ledger and the manifest's header checks used the header :func:`open_source`
    read; a file re-published since may hold the same tensors at other offsets (read there; their
    content hashes decide), but a tensor whose dtype or shape changed, or that is gone, would
    reach loaders that were never dry-run with it, so it is refused.

    Raises:
        SourceUnavailable: naming the file and the first tensor that changed or is gone.
    """
    from engine_agent.manifest import ManifestError, read_safetensors_header

    try:
        data_start, header = read_safetensors_header(handle, file.name)
    except ManifestError as e:
        raise SourceUnavailable(f"cannot read {file}: {e}", field="path") from e
    placed = []
    for info in infos:
        begin = _same_tensor_at(header.get(info.name), info)
        if begin is None:
            raise SourceUnavailable(
                f"{file} changed while the update ran: tensor {info.name!r} no longer has the "
                "dtype and shape its header had when the batch was checked; re-run the update "
                "once the file is complete",
                field=info.name,
            )
        placed.append(replace(info, offset=data_start + begin))
    return placed


def _same_tensor_at(entry: Any, info: TensorInfo) -> int | None:
    """The data offset of header ``entry`` if it has ``info``'s dtype, shape and size, else None."""
    if not isinstance(entry, dict):
        return None
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    if not (isinstance(offsets, list) and len(offsets) == 2 and isinstance(shape, list)):
        return None
    if entry.get("dtype") != safetensors_dtype(info.dtype) or shape != list(info.shape):
        return None
    begin, end = offsets
    if not (isinstance(begin, int) and isinstance(end, int) and end - begin == info.nbytes):
        return None
    return begin


def read_ahead(
    handle: io.RawIOBase, infos: list[TensorInfo]
) -> Iterator[tuple[TensorInfo, torch.Tensor]]:
    """Yield ``(info, tensor)`` in order, reading the next ones on a thread while the caller works.

    The extra copy out of the page cache is what owning the bytes costs; one reader thread
    (``readinto`` releases the GIL) does it while the loaders process the tensor before, at
    most :data:`READ_AHEAD_BYTES` ahead (at least one tensor). Only that thread touches
    ``handle``; it is stopped before the caller closes it.
    """
    reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightroll-read")
    waiting = deque(infos)
    ahead: deque[tuple[TensorInfo, Future[torch.Tensor]]] = deque()
    ahead_bytes = 0
    try:
        while waiting or ahead:
            while waiting and (not ahead or ahead_bytes + waiting[0].nbytes <= READ_AHEAD_BYTES):
                info = waiting.popleft()
                ahead.append((info, reader.submit(_read_owned, handle, info)))
                ahead_bytes += info.nbytes
            info, future = ahead.popleft()
            ahead_bytes -= info.nbytes
            yield info, future.result()
    finally:
        for _, future in ahead:
            future.cancel()
        reader.shutdown(wait=True)


def _read_owned(handle: io.RawIOBase, info: TensorInfo) -> torch.Tensor:
    """Read one tensor's bytes from ``handle`` into a new host buffer the rank owns.

    Never a view of the file, so a writer cannot change the bytes after they were read.

    Raises:
        SourceUnavailable: the file ends before the tensor does, or the read fails.
    """
    expected = info.shape.numel() * info.dtype.itemsize
    if expected != info.nbytes:
        raise SourceUnavailable(
            f"{info.file}: tensor {info.name!r} spans {info.nbytes} bytes but its dtype and "
            f"shape need {expected}",
            field=info.name,
        )
    buffer = torch.empty(info.nbytes, dtype=torch.uint8)
    view = buffer.numpy().data
    done = 0
    try:
        handle.seek(info.offset)
        while done < info.nbytes:
            count = handle.readinto(view[done:])
            if not count:
                break
            done += count
    except OSError as e:
        raise SourceUnavailable(f"cannot read {info.file}: {e}", field="path") from e
    if done != info.nbytes:
        raise SourceUnavailable(
            f"{info.file} was truncated while the update ran: tensor {info.name!r} ends at byte "
            f"{info.offset + info.nbytes}, the file at {info.offset + done}",
            field=info.name,
        )
    return buffer.view(info.dtype).reshape(info.shape)


def torch_dtype(name: str) -> torch.dtype:
    reverse = {v: k for k, v in _DTYPE_NAMES.items()}
    if name not in reverse:
        raise SourceUnavailable(f"unsupported tensor dtype {name}", field="path")
    return reverse[name]
