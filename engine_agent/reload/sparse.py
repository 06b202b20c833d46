"""Sparse patch files: flat-index updates in checkpoint coordinates.

Format (one safetensors file; documented in docs/engine.md):

* for every patched checkpoint tensor ``N``: ``N::indices`` (int64, 1-D, positions in the
  row-major flattened tensor) and ``N::values`` (1-D, the parameter's dtype, same length);
* metadata ``weightroll.sparse = "v1"``, ``weightroll.base_version = <version>`` and
  ``shape::N = "d0,d1,..."`` (the full checkpoint shape of ``N``).

Patches are applied only where the live layout equals the checkpoint layout (planned by
:mod:`engine_agent.reload.sparse_plan`, written by ``LoadRouter.apply_sparse``). Indices are
checkpoint coordinates: each rank maps them through the parameter's shard layout and applies
only the elements it holds (under TP a rank skips the rows another rank owns). A patch is only
correct against its base version, which the session checks before it opens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from engine_agent.errors import InvalidRequest, ShapeMismatch

__all__ = ["FORMAT", "read_patches", "write_patch"]

FORMAT = "v1"
_INDICES, _VALUES = "::indices", "::values"


def write_patch(
    path: Path,
    base_version: str,
    patches: Mapping[str, tuple[tuple[int, ...], torch.Tensor, torch.Tensor]],
) -> Path:
    """Write ``{name: (checkpoint shape, indices, values)}`` as a sparse patch file."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    metadata = {"weightroll.sparse": FORMAT, "weightroll.base_version": base_version}
    for name, (shape, indices, values) in patches.items():
        tensors[name + _INDICES] = indices.to(torch.int64).contiguous()
        tensors[name + _VALUES] = values.contiguous()
        metadata[f"shape::{name}"] = ",".join(str(d) for d in shape)
    save_file(tensors, str(path), metadata=metadata)
    return path


def read_patches(checkpoint: Any) -> list[tuple[str, torch.Size, torch.Tensor, torch.Tensor]]:
    """Parse a :class:`engine_agent.reload.sources.CheckpointSource` holding a sparse patch.

    The indices and values returned are the source's own host buffers, the bytes its content
    hashes cover: the caller verifies them (``checkpoint.complete()``) and applies these same
    tensors, so nothing reads the patch file again after it was checked (issue 26, item 2).

    Raises:
        InvalidRequest: the file is not a weightroll sparse patch, or an entry is incomplete or
            its shape metadata malformed (naming the tensor).
        ShapeMismatch: an entry's indices and values are not 1-D of equal length.
    """
    metadata: dict[str, str] = checkpoint.metadata
    if metadata.get("weightroll.sparse") != FORMAT:
        raise InvalidRequest(
            "source is not a weightroll sparse patch (metadata 'weightroll.sparse' must be "
            f"{FORMAT!r}); sparse updates need a patch file, full updates a checkpoint",
            field="path",
        )
    tensors = dict(checkpoint.tensors())
    names = sorted({n.rsplit("::", 1)[0] for n in tensors})
    patches = []
    for name in names:
        indices, values = tensors.get(name + _INDICES), tensors.get(name + _VALUES)
        shape = metadata.get(f"shape::{name}")
        if indices is None or values is None or shape is None:
            raise InvalidRequest(
                f"sparse patch entry {name!r} needs '{name}{_INDICES}', '{name}{_VALUES}' and "
                f"metadata 'shape::{name}'",
                field=name,
            )
        if indices.dtype != torch.int64:
            raise InvalidRequest(f"{name}{_INDICES} must be int64, got {indices.dtype}", field=name)
        if indices.dim() != 1 or values.shape != indices.shape:
            raise ShapeMismatch(
                f"{name}: {name}{_INDICES} and {name}{_VALUES} must be 1-D and of equal length "
                f"(got {list(indices.shape)} and {list(values.shape)})",
                field=name,
            )
        patches.append((name, _shape(name, shape), indices, values))
    return patches


def _shape(name: str, text: str) -> torch.Size:
    """Parse metadata ``shape::<name>`` (``"d0,d1,..."``, non-negative integers).

    Raises:
        InvalidRequest: naming the tensor, before anything reaches a loader (a malformed shape
            used to surface as an ``internal`` error of whatever first tripped over it).
    """
    dims = [d.strip() for d in text.split(",") if d.strip()]
    if not all(d.isascii() and d.isdigit() for d in dims):
        raise InvalidRequest(
            f"sparse patch metadata 'shape::{name}' is {text!r}: it must list the checkpoint "
            "shape as non-negative integers separated by commas",
            field=name,
        )
    return torch.Size(int(d) for d in dims)
