"""The inventory of kernel-read state (engine_agent/reload/inventory.py), on plain torch modules."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine_agent.reload.inventory import CHECKPOINT, DERIVED, RUNTIME, Inventory, build_inventory


@dataclass
class _Entry:
    module: nn.Module
    templates: dict[str, torch.Tensor] = field(default_factory=lambda: {"weight": torch.empty(0)})


def _packed(layer: nn.Module) -> None:
    copy = layer.weight.detach().clone()
    layer.cpu_linear = lambda x, _w, b: torch.nn.functional.linear(x, copy, b)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.randn(8, 4))
        self.head = nn.Module()
        self.head.weight = self.embed.weight  # tied
        _packed(self.head)
        self.rotary = nn.Module()
        self.rotary.register_buffer("cos_sin_cache", torch.randn(4, 2))
        self.rotary.table = torch.randn(3)  # weight-independent: no checkpoint source
        self.embed.scale_copy = torch.ones(1)  # derived from embed, nothing rebuilds it


def _inventory(model: _Model, post_load: bool = True) -> Inventory:
    entries = {"embed": _Entry(model.embed)}
    holders = {id(model.embed.weight): "embed"}
    return build_inventory(model, entries, holders, {}, {"head": post_load})


def test_tensors_and_kernels_are_classified_with_their_sources() -> None:
    model = _Model()
    items = _inventory(model).items
    assert items["embed.weight"].kind == CHECKPOINT
    assert items["head.weight"].kind == CHECKPOINT  # the tied parameter, held by the head
    assert items["head.weight"].sources == {"embed"}
    assert items["head.cpu_linear"].kind == DERIVED
    assert items["head.cpu_linear"].sources == {"embed"}
    assert items["head.cpu_linear"].refresher == "post_load:head"
    assert items["rotary.cos_sin_cache"].kind == RUNTIME
    assert items["rotary.table"].kind == RUNTIME
    assert items["embed.scale_copy"].kind == DERIVED and items["embed.scale_copy"].refresher is None


class _OneDnnHandle:
    """Stands for vLLM's oneDNN matmul handle: opaque, holding the packed weight inside."""


def test_kernels_closing_over_opaque_handles_or_sizes_are_kernel_state() -> None:
    """vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``) picks by CPU: on AVX-512
    BF16 machines ``cpu_linear`` closes over a oneDNN handle, or over a packed tensor and the
    output size ``N``. Before: any non-tensor cell raised ``TypeError`` (``tuple | type``), so
    every update failed on those CPUs at ``weightroll_begin``."""
    model = _Model()
    handle = _OneDnnHandle()
    model.head.cpu_linear = lambda x, weight, bias: (handle, x, bias)
    assert _inventory(model).items["head.cpu_linear"].kind == DERIVED
    n, packed = 8, torch.randn(8, 4)
    model.head.cpu_linear = lambda x, weight, bias: (packed, n, x, bias)
    assert _inventory(model).items["head.cpu_linear"].kind == DERIVED
    size, module = 8, nn.Module()  # sizes and modules alone are no kernel state
    model.head.cpu_linear = lambda x, weight, bias: (size, module, x, bias)
    assert "head.cpu_linear" not in _inventory(model).items


def test_a_derived_item_without_refresher_is_reported_for_its_sources_only() -> None:
    inventory = _inventory(_Model())
    assert [i.name for i in inventory.unsupported({"embed"})] == ["embed.scale_copy"]
    assert inventory.unsupported({"other"}) == []
    no_post_load = _inventory(_Model(), post_load=False)
    names = {i.name for i in no_post_load.unsupported({"embed"})}
    assert names == {"embed.scale_copy", "head.cpu_linear"}


def test_finish_requires_every_derived_item_of_an_updated_source_to_be_rebuilt() -> None:
    model = _Model()
    inventory = _inventory(model)
    with torch.no_grad():
        model.embed.weight.add_(1.0)  # the tied weight changed in place
    problems = inventory.compare(model, {"embed"}, set())
    assert any(p.startswith("head.cpu_linear: derived from ['embed']") for p in problems)
    _packed(model.head)
    rebuilt = set(inventory.rebuilt_since("head", model.head))
    assert rebuilt == {"head.cpu_linear"}
    problems = inventory.compare(model, {"embed"}, rebuilt | {"embed.scale_copy"})
    assert problems == []


def test_a_kernel_replaced_while_its_sources_did_not_change_is_a_problem() -> None:
    model = _Model()
    inventory = _inventory(model)
    _packed(model.head)
    problems = inventory.compare(model, set(), set())
    assert problems == ["head.cpu_linear: kernel object replaced, but none of its sources changed"]


def test_a_moved_tensor_is_a_problem() -> None:
    model = _Model()
    inventory = _inventory(model)
    model.rotary.cos_sin_cache = torch.randn(4, 2)
    problems = inventory.compare(model, set(), set())
    assert len(problems) == 1 and problems[0].startswith("rotary.cos_sin_cache: storage changed")


def test_runtime_state_kept_in_a_list_is_runtime_state() -> None:
    """Qwen3-Next's linear-attention layers keep their state caches as ``kv_cache = [conv,
    ssm]`` on a module that holds checkpoint weights: the items are ``kv_cache.0`` and
    ``kv_cache.1``, and were classified derived with no refresher, so every update touching
    the layer was refused (docs/models.md)."""
    model = _Model()
    model.embed.kv_cache = [torch.zeros(2, 4), torch.zeros(3)]
    model.embed.impl_state = [torch.ones(2)]  # any other list on it stays derived
    items = _inventory(model).items
    assert items["embed.kv_cache.0"].kind == RUNTIME
    assert items["embed.kv_cache.1"].kind == RUNTIME
    assert items["embed.impl_state.0"].kind == DERIVED


def test_a_view_of_a_checkpoint_parameter_reads_its_bytes() -> None:
    """Mamba mixers keep ``conv_weights``, a reshaped view of ``conv1d.weight``, as a buffer of
    a module that holds other checkpoint weights: it was classified derived with no refresher,
    so GraniteMoeHybrid, Falcon-H1 and the other mamba hybrids refused every update. It reads
    the parameter's storage, which the update writes in place: a checkpoint item of its
    holder. A copy of it (not a view) is still derived."""
    model = _Model()
    model.embed.register_buffer("flat", model.embed.weight.detach().view(-1), persistent=False)
    model.embed.copied = model.embed.weight.detach().clone().view(-1)
    items = _inventory(model).items
    assert items["embed.flat"].kind == CHECKPOINT and items["embed.flat"].sources == {"embed"}
    assert items["embed.copied"].kind == DERIVED and items["embed.copied"].refresher is None


def test_gemma3n_router_input_scale_is_a_config_constant() -> None:
    """Gemma 3n's AltUp keeps ``router_input_scale`` (hidden_size ** -1) as a non-persistent
    buffer beside its router's parameters: it was classified derived with no refresher, so every
    full or partial update of Gemma 3n was refused (docs/models.md)."""
    model = _Model()
    model.embed.register_buffer("router_input_scale", torch.tensor(4**-1.0), persistent=False)
    items = _inventory(model).items
    assert items["embed.router_input_scale"].kind == RUNTIME
    assert _inventory(model).unsupported({"embed"})[0].name == "embed.scale_copy"
