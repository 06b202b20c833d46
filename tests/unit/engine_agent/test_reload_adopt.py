"""A prefetch's staging adopts a read buffer a loader copies whole (``reload/adopt.py``).

The loaders here are shaped like vLLM's: ``default_weight_loader`` (``param.data.copy_``), a
fused parameter's loader (a narrowed slice's ``copy_``), and a loader that pads after copying.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine_agent.errors import LoaderUnsupported
from engine_agent.reload.adopt import Adoptions


def _buffer(*shape: int, seed: int = 0) -> torch.Tensor:
    """A read buffer as :mod:`engine_agent.reload.owned_reads` makes one."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(*shape, generator=generator).to(torch.bfloat16)
    buffer = torch.empty(values.numel() * 2, dtype=torch.uint8)
    buffer.view(torch.bfloat16).copy_(values.reshape(-1))
    return buffer.view(torch.bfloat16).reshape(shape)


def _load(
    adoptions: Adoptions,
    staging: torch.Tensor,
    loaded: torch.Tensor,
    loader: Callable[[torch.Tensor, torch.Tensor], None],
    module: str = "layer",
) -> None:
    adoptions.reading(loaded)
    with adoptions.during(module, "weight", staging):
        loader(staging, loaded)


def _whole(param: torch.Tensor, loaded: torch.Tensor) -> None:
    param.data.copy_(loaded)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_a_whole_copy_adopts_the_buffer_instead_of_copying_it() -> None:
    adoptions = Adoptions(lambda _module: False)
    staging, loaded = torch.empty(4, 8, dtype=torch.bfloat16), _buffer(4, 8)
    _load(adoptions, staging, loaded, _whole)
    assert staging.data_ptr() == loaded.data_ptr()
    assert adoptions.bytes_adopted == loaded.numel() * 2


@pytest.mark.parametrize(
    "loaded",
    [
        _buffer(8, 8)[:4],  # a part of a larger read (its storage holds more)
        _buffer(8, 4).t(),  # not contiguous
        _buffer(4, 8).float(),  # another dtype: the loader converts
    ],
    ids=["part-of-a-buffer", "transposed", "other-dtype"],
)
def test_a_copy_that_is_not_plain_and_whole_is_run_as_asked(loaded: torch.Tensor) -> None:
    adoptions = Adoptions(lambda _module: False)
    staging = torch.empty(4, 8, dtype=torch.bfloat16)
    pointer = staging.data_ptr()
    _load(adoptions, staging, loaded, _whole)
    assert staging.data_ptr() == pointer and adoptions.bytes_adopted == 0
    assert torch.equal(staging, loaded.to(torch.bfloat16).contiguous())


def test_a_slice_of_a_fused_parameter_is_copied() -> None:
    adoptions = Adoptions(lambda _module: False)
    staging, loaded = torch.empty(8, 8, dtype=torch.bfloat16), _buffer(4, 8)
    pointer = staging.data_ptr()
    _load(adoptions, staging, loaded, lambda p, w: p.data.narrow(0, 4, 4).copy_(w))
    assert staging.data_ptr() == pointer and _same(staging[4:], loaded)


def test_a_write_after_the_adopted_copy_lands_in_the_staging() -> None:
    """A loader that copies whole then writes more: the staging holds what it meant."""
    adoptions = Adoptions(lambda _module: False)
    staging, loaded = torch.empty(4, 8, dtype=torch.bfloat16), _buffer(4, 8)
    expected = loaded.clone()
    expected[0].zero_()

    def copy_then_zero_first_row(param: torch.Tensor, weight: torch.Tensor) -> None:
        param.data.copy_(weight)
        param.data[0].zero_()

    _load(adoptions, staging, loaded, copy_then_zero_first_row)
    assert _same(staging, expected)


def test_a_buffer_read_by_a_second_loader_gives_the_first_a_private_copy() -> None:
    adoptions = Adoptions(lambda _module: False)
    first, second = (torch.empty(4, 8, dtype=torch.bfloat16) for _ in range(2))
    loaded = _buffer(4, 8)
    _load(adoptions, first, loaded, _whole, module="a")
    _load(adoptions, second, loaded, _whole, module="b")
    assert first.data_ptr() != loaded.data_ptr() and second.data_ptr() != loaded.data_ptr()
    first.zero_()  # the first one's processing rewrites it in place: the second keeps the read
    assert _same(second, loaded) and adoptions.bytes_adopted == 0


def test_a_second_reader_after_the_adopter_was_processed_is_refused() -> None:
    adoptions = Adoptions(lambda module: module == "a")
    loaded = _buffer(4, 8)
    _load(adoptions, torch.empty(4, 8, dtype=torch.bfloat16), loaded, _whole, module="a")
    with pytest.raises(LoaderUnsupported, match=r"a\.weight: .*second loader"):
        adoptions.reading(loaded)
