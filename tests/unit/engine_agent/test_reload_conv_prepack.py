"""The CPU causal-conv1d prepack refresher (engine_agent/reload/derived.py).

At a cold load, vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``, the conv1d's
post-load step) replaces a causal conv1d weight's storage with its prepacked form and keeps the
un-packed ``(dim, width)`` weight as ``_cpu_unpacked_conv_weight`` (Qwen3-Next's gated delta
net reads it). ``MambaMixer2`` (FalconH1, GraniteMoeHybrid) built ``conv_weights`` as a view of
the weight before that, so it is left holding the old storage: a copy of the checkpoint weight
no longer shared with the parameter. Both were derived state with no refresher, and every full
or partial update of those families was refused (issue 26).

The prepack here is vLLM's own step, called directly on small tensors (no engine).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="the prepack is vLLM's")

from engine_agent.reload.derived import CPU_UNPACKED_CONV, find_refreshers

DIM, WIDTH = 64, 4


def _prepack(layer: nn.Module) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def _needs_prepack() -> None:
    probe = nn.Module()
    probe.weight = nn.Parameter(torch.zeros(DIM, 1, WIDTH, dtype=torch.bfloat16), False)
    _prepack(probe)
    if CPU_UNPACKED_CONV not in vars(probe):
        pytest.skip("this CPU has no causal-conv1d prepack (AVX512-BF16 or aarch64 bf16)")


class MambaMixer2(nn.Module):
    """vLLM's mixer, as far as the refresher sees it (it finds the view by the class name): a
    ``conv1d`` child and a non-persistent ``conv_weights`` buffer built as a ``(dim, width)``
    view of its weight, as ``MambaMixer2.__init__`` builds it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(weight, requires_grad=False)
        view = self.conv1d.weight.view(DIM, WIDTH)
        self.register_buffer("conv_weights", view, persistent=False)


def _checkpoint(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(DIM, 1, WIDTH, generator=g).to(torch.bfloat16)


def _cold(weight: torch.Tensor) -> MambaMixer2:
    mixer = MambaMixer2(weight.clone())
    _prepack(mixer.conv1d)  # the conv1d's post-load step at a cold load
    return mixer


def test_the_refresher_rebuilds_the_unpacked_weight_and_the_mixer_view_in_place() -> None:
    _needs_prepack()
    live = _cold(_checkpoint(0))
    # the prepack moved the parameter: the mixer's view now holds storage of its own
    assert live.conv_weights.data_ptr() != live.conv1d.weight.data_ptr()
    refreshers, unsupported = find_refreshers(live, {id(live.conv1d): "conv1d"})
    assert unsupported == {}
    (refresher,) = refreshers["conv1d"]
    kept = {name: (t, t.data_ptr()) for name, t in refresher.tensors().items()}
    assert set(kept) == {f"conv1d.{CPU_UNPACKED_CONV}", "conv_weights"}

    # an update, as ModuleProcessor.process runs it: the staged checkpoint weight in the slot,
    # the conv1d's post-load step on it, then the refresher
    b = _checkpoint(1)
    live.conv1d.weight = nn.Parameter(b.clone(), requires_grad=False)
    _prepack(live.conv1d)
    assert sorted(refresher.refresh(torch.bfloat16)) == sorted(kept)

    cold = _cold(b)
    assert torch.equal(vars(live.conv1d)[CPU_UNPACKED_CONV], vars(cold.conv1d)[CPU_UNPACKED_CONV])
    assert torch.equal(live.conv_weights, cold.conv_weights)
    assert torch.equal(live.conv1d.weight, cold.conv1d.weight)  # the packed form
    for name, tensor in refresher.tensors().items():
        assert tensor is kept[name][0] and tensor.data_ptr() == kept[name][1], f"{name} moved"
    assert vars(live.conv1d)[CPU_UNPACKED_CONV] is kept[f"conv1d.{CPU_UNPACKED_CONV}"][0]

    # without a fresh post-load step (a sparse rebuild) nothing is claimed as rebuilt
    assert refresher.refresh(torch.bfloat16) == []


def test_a_conv_vllm_did_not_prepack_gets_no_refresher() -> None:
    """Its view still shares the parameter's storage: the inventory counts it as the checkpoint
    parameter itself, which the update writes in place."""
    mixer = MambaMixer2(_checkpoint(0))
    assert mixer.conv_weights.data_ptr() == mixer.conv1d.weight.data_ptr()
    refreshers, unsupported = find_refreshers(mixer, {id(mixer.conv1d): "conv1d"})
    assert refreshers == {} and unsupported == {}
