"""The census oracle itself (tests/harness/census.py) finds what a stale derived copy looks like.

An oracle that cannot fail proves nothing: each case builds two toy models that hold weights the
ways vLLM's kernels do (parameter, tensor attribute, list, closure, ``functools.partial``,
opaque handle) and checks that the census reaches each place and that a difference in any one
of them is reported by name.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.harness.census import census, differences, moved


class Toy(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(
            torch.randn(4, 3, generator=generator), requires_grad=False
        )
        self.register_buffer("scale", torch.ones(4))
        self.W_UK_T = self.weight.detach().t().clone()  # a derived copy in an attribute
        self.scales = [torch.full((2,), 0.5)]
        packed = self.weight.detach().clone()  # a kernel's private copy
        handle = torch.tensor(140_000_000 + seed)  # an opaque handle: an address

        def cpu_linear(x: torch.Tensor, _weight: object, bias: object) -> torch.Tensor:
            assert handle is not None
            return torch.nn.functional.linear(x, packed)

        self.cpu_linear = cpu_linear
        self.partial = functools.partial(torch.add, torch.zeros(3))
        self.kv_cache = [torch.randn(2, generator=generator)]  # runtime state: not compared


def _captured(function: object, name: str) -> torch.Tensor:
    code = function.__code__  # type: ignore[attr-defined]
    cell = function.__closure__[code.co_freevars.index(name)]  # type: ignore[attr-defined]
    value: torch.Tensor = cell.cell_contents
    return value


def test_the_census_reaches_every_place_a_kernel_reads() -> None:
    names = set(census(Toy(0)))
    assert {"weight", "scale", "W_UK_T", "scales[0]", "cpu_linear<packed>"} <= names
    assert "cpu_linear<applied to the identity>" in names
    assert "partial.args[0]" in names
    assert not any("kv_cache" in name or "handle" in name for name in names)


def test_same_weights_compare_equal_whatever_the_address() -> None:
    assert differences(census(Toy(0)), census(Toy(0))) == []


@pytest.mark.parametrize(
    ("stale", "named"),
    [
        (lambda toy: toy.W_UK_T.add_(1), "W_UK_T"),
        (lambda toy: toy.scales[0].add_(1), "scales[0]"),
        (lambda toy: _captured(toy.cpu_linear, "packed").add_(1), "cpu_linear<packed>"),
        (lambda toy: toy.scale.add_(1), "scale"),
    ],
)
def test_a_stale_copy_is_reported_by_name(stale: object, named: str) -> None:
    fresh, live = Toy(0), Toy(0)
    stale(live)  # type: ignore[operator]
    found = differences(census(live), census(fresh))
    assert any(line.startswith(f"{named}:") for line in found), found


def test_a_moved_parameter_is_reported_and_a_rebuilt_kernel_is_not() -> None:
    toy = Toy(0)
    before = census(toy)
    toy.weight.data = toy.weight.data.clone()
    toy.cpu_linear = Toy(0).cpu_linear  # a rebuilt kernel: a new closure, a new private copy
    assert moved(before, census(toy)) == ["weight: storage or layout changed"]
