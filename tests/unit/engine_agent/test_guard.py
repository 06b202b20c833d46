"""The still-true-now guard (engine_agent/reload/guard.py) on real tensors and a virtual clock."""

from __future__ import annotations

import pytest
import torch

from engine_agent.reload.guard import StillTrueGuard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))


def _guard(model: torch.nn.Module, clock: Clock, period: float = 30.0) -> StillTrueGuard:
    kernels = {"0": "Linear"}
    return StillTrueGuard(
        tensors=lambda: dict(model.named_parameters()),
        kernels=lambda: dict(kernels),
        period=period,
        clock=clock,
    )


def test_unchanged_weights_stay_true_and_content_is_read_when_due(model: torch.nn.Module) -> None:
    clock = Clock()
    guard = _guard(model, clock)
    guard.seal()
    assert guard.violations() == []
    assert guard.content_checks == 0  # not due yet: identity only
    clock.now += 30
    assert guard.violations() == []
    assert guard.content_checks == 1


def test_a_stray_in_place_write_is_found_at_the_next_content_check(model: torch.nn.Module) -> None:
    clock = Clock()
    guard = _guard(model, clock)
    guard.seal()
    with torch.no_grad():
        model[1].bias.add_(1.0)  # same storage, other bytes
    assert guard.violations() == []  # identity is unchanged; content is not due
    clock.now += 30
    assert guard.violations() == ["1.bias: content changed since the commit"]


def test_forced_content_check_finds_it_at_once(model: torch.nn.Module) -> None:
    guard = _guard(model, Clock())
    guard.seal()
    with torch.no_grad():
        model[0].weight[3, 3] += 1
    assert guard.violations(force_content=True) == ["0.weight: content changed since the commit"]


def test_moved_storage_is_found_on_every_call(model: torch.nn.Module) -> None:
    guard = _guard(model, Clock())
    guard.seal()
    model[0].weight.data = model[0].weight.data.clone()  # what a foreign reload may do
    (problem,) = guard.violations()
    assert problem.startswith("0.weight: storage changed")


def test_a_changed_kernel_is_found(model: torch.nn.Module) -> None:
    kernels = {"0": "Linear"}
    guard = StillTrueGuard(
        tensors=lambda: dict(model.named_parameters()), kernels=lambda: dict(kernels)
    )
    guard.seal()
    kernels["0"] = "Linear cpu_gemm=other:1"
    assert guard.violations() == ["0: kernel changed 'Linear' -> 'Linear cpu_gemm=other:1'"]


def test_unsealed_claims_nothing(model: torch.nn.Module) -> None:
    guard = _guard(model, Clock(), period=0)
    assert guard.violations() == []
    guard.seal()
    guard.unseal()
    with torch.no_grad():
        model[1].weight.mul_(2)
    assert guard.violations() == []


def test_describe_names_a_bounded_number_of_tensors() -> None:
    problems = [f"t{i}: content changed since the commit" for i in range(5)]
    line = StillTrueGuard.describe(problems)
    assert line.startswith("still_true_violated: t0: content changed")
    assert line.endswith("(and 2 more)")
    assert "t3" not in line


def test_a_seal_with_known_digests_reads_only_the_others_and_catches_a_wrong_copy(
    model: torch.nn.Module,
) -> None:
    """A prefetched update seals the digests of the bytes it meant to copy (issue 30): right
    ones stay true, and a live byte that is not what was meant is found at the first check."""
    from engine_agent.reload.digest import tensor_digest

    clock = Clock()
    guard = _guard(model, clock)
    meant = model[0].weight.detach().clone()
    guard.seal(known={"0.weight": tensor_digest(meant)})
    assert guard.violations(force_content=True) == []
    wrong = meant.clone()
    wrong[0, 0] += 1  # the copy was meant to write other bytes than the live ones hold
    guard.seal(known={"0.weight": tensor_digest(wrong)})
    assert guard.violations(force_content=True) == ["0.weight: content changed since the commit"]
