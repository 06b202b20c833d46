"""Sparse patch files are refused by name when malformed, before anything reaches a loader.

Issue 26, item 8: a patch whose shape metadata was not a list of non-negative integers raised
``internal`` (a ``ValueError`` from ``int()``, or a ``RuntimeError`` from a tensor of negative
size) instead of a refusal naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_agent.errors import InvalidRequest, ShapeMismatch
from engine_agent.reload.sources import open_source
from engine_agent.reload.sparse import read_patches, write_patch

NAME = "model.norm.weight"


def _raw_patch(path: Path, indices: torch.Tensor, values: torch.Tensor, shape: str) -> Path:
    metadata = {
        "weightroll.sparse": "v1",
        "weightroll.base_version": "v1",
        f"shape::{NAME}": shape,
    }
    save_file({f"{NAME}::indices": indices, f"{NAME}::values": values}, str(path), metadata)
    return path


def test_a_well_formed_patch_reads_back(tmp_path: Path) -> None:
    values = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    path = write_patch(
        tmp_path / "p.safetensors", "v1", {NAME: ((8,), torch.tensor([3, 5]), values)}
    )
    ((name, shape, indices, read),) = read_patches(open_source(str(path)))
    assert (name, shape, indices.tolist()) == (NAME, torch.Size([8]), [3, 5])
    assert torch.equal(read, values)


@pytest.mark.parametrize("shape", ["x,y", "-1", "8,-2", "1.5", "8;8"])
def test_malformed_shape_metadata_is_refused_naming_the_tensor(tmp_path: Path, shape: str) -> None:
    path = _raw_patch(
        tmp_path / "p.safetensors",
        torch.tensor([0, 1]),
        torch.zeros(2, dtype=torch.bfloat16),
        shape,
    )
    with pytest.raises(InvalidRequest) as refused:
        read_patches(open_source(str(path)))
    assert refused.value.field == NAME
    assert f"shape::{NAME}" in refused.value.message and repr(shape) in refused.value.message


@pytest.mark.parametrize(
    ("indices", "values"),
    [
        (torch.tensor([0, 1, 2]), torch.zeros(2, dtype=torch.bfloat16)),
        (torch.tensor([[0, 1]]), torch.zeros(1, 2, dtype=torch.bfloat16)),
        (torch.tensor([0, 1]), torch.zeros(2, 1, dtype=torch.bfloat16)),
    ],
)
def test_indices_and_values_that_do_not_pair_up_are_refused_naming_the_tensor(
    tmp_path: Path, indices: torch.Tensor, values: torch.Tensor
) -> None:
    path = _raw_patch(tmp_path / "p.safetensors", indices, values, "8")
    with pytest.raises(ShapeMismatch) as refused:
        read_patches(open_source(str(path)))
    assert refused.value.field == NAME and NAME in refused.value.message
