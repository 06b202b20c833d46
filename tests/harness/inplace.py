"""Rewrite a checkpoint file under a reader, as ``rsync --inplace`` does (same inode)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine_agent.manifest import read_safetensors_header
from engine_agent.reload.digest import host_bytes

__all__ = ["rewrite_in_place"]


def rewrite_in_place(file: Path, name: str, tensor: torch.Tensor) -> None:
    """Overwrite tensor ``name``'s bytes inside safetensors ``file`` with ``tensor``'s (same
    layout required): same inode, so an open mmap or a reader mid-file sees the new bytes."""
    with file.open("r+b") as handle:
        data_start, header = read_safetensors_header(handle, file.name)
        start, end = header[name]["data_offsets"]
        raw = host_bytes(tensor).tobytes()
        assert len(raw) == end - start
        handle.seek(data_start + start)
        handle.write(raw)
