"""Reading checkpoint tensors for one rank: safetensors files or directories, mmap-backed.

Every problem with the source is raised as an :mod:`engine_agent.errors` error naming the file
or tensor, before any byte reaches the model: missing path, not safetensors, truncated file,
unknown requested names, and (when a manifest is given) bytes whose SHA-256, dtype or shape
differ from the manifest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine_agent.errors import ManifestMismatch, SourceUnavailable, UnknownTensor

__all__ = ["CheckpointSource", "TensorInfo", "open_source", "safetensors_dtype"]

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


class CheckpointSource:
    """The tensors one ``weightroll_load`` call reads, with their headers already validated."""

    def __init__(self, files: list[Path], infos: dict[str, TensorInfo], metadata: dict[str, str]):
        self.files = files
        self.infos = infos
        self.metadata = metadata

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` file by file (each file memory-mapped once)."""
        from safetensors import safe_open

        for file in self.files:
            names = [n for n, info in self.infos.items() if info.file == file]
            if not names:
                continue
            try:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in names:
                        yield name, handle.get_tensor(name)
            except (OSError, RuntimeError, ValueError) as e:
                raise SourceUnavailable(f"cannot read {file}: {e}", field="path") from e

    def verify(self, manifest: Any) -> None:
        """Check every tensor's stored bytes against ``manifest`` (a ``Manifest``).

        Raises:
            ManifestMismatch: naming the first tensor that differs.
        """
        from engine_agent.manifest import ManifestError

        for name, tensor in self.tensors():
            info = self.infos[name]
            data = tensor.reshape(-1).contiguous().view(torch.uint8).numpy()
            try:
                manifest.verify(
                    name, data, dtype=safetensors_dtype(info.dtype), shape=list(info.shape)
                )
            except ManifestError as e:
                raise ManifestMismatch(str(e), field=name) from e


def open_source(path: str, names: Sequence[str] | None = None) -> CheckpointSource:
    """Validate ``path`` (a safetensors file or a directory of them) and read its headers.

    Raises:
        SourceUnavailable: the path is missing, empty, not safetensors or truncated.
        UnknownTensor: a requested name is in none of the files.
    """
    from safetensors import safe_open

    root = Path(path)
    if root.is_dir():
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise SourceUnavailable(f"{root} contains no *.safetensors files", field="path")
    elif root.is_file():
        files = [root]
    else:
        raise SourceUnavailable(f"{root} does not exist", field="path")
    infos: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for file in files:
        try:
            size = file.stat().st_size
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                metadata |= handle.metadata() or {}
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    piece = handle.get_slice(name)
                    infos[name] = TensorInfo(
                        name, file, torch.Size(piece.get_shape()), _torch_dtype(piece.get_dtype())
                    )
            _check_not_truncated(file, size)
        except SourceUnavailable:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise SourceUnavailable(
                f"{file} is not a readable safetensors file: {e}", field="path"
            ) from e
    if names is not None:
        unknown = sorted(set(names) - infos.keys())
        if unknown:
            raise UnknownTensor(
                f"requested tensor(s) not found in {root}: {', '.join(unknown[:8])}", field="names"
            )
        infos = {n: infos[n] for n in names}
    return CheckpointSource(files, infos, metadata)


def _check_not_truncated(file: Path, size: int) -> None:
    from engine_agent.manifest import read_safetensors_header

    with file.open("rb") as handle:
        data_start, header = read_safetensors_header(handle, file.name)
    end = data_start + max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if end > size:
        raise SourceUnavailable(
            f"{file} is truncated: its header promises {end} bytes, the file has {size}",
            field="path",
        )


def _torch_dtype(name: str) -> torch.dtype:
    reverse = {v: k for k, v in _DTYPE_NAMES.items()}
    if name not in reverse:
        raise SourceUnavailable(f"unsupported tensor dtype {name}", field="path")
    return reverse[name]
