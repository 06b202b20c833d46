"""Checkpoint buffers: persistent buffers vLLM's ``AutoWeightsLoader`` loads by name
(engine_agent/reload/index.py ``_checkpoint_buffers``, modelwise.py, processing.py).

Apertus's XIELU activation keeps ``alpha_p``/``alpha_n`` as parameters and ``beta``/``eps`` as
persistent buffers; the checkpoint writes all four, and a cold engine reads the checkpoint's
``beta`` and ``eps`` in every forward. Taken for derived state with no refresher, they refused
every full and partial update of Apertus at ``begin`` (issue 26). Gemma 4's decoder layer, a
module with no parameter of its own, keeps a persistent ``layer_scalar`` the checkpoint writes;
left out of the index, the check run's meta tensor reached the live buffer and every full and
partial Gemma 4 update was refused. The modules under test are vLLM's own ``XIELU`` and a
parameterless layer with a persistent buffer, loaded by vLLM's own ``AutoWeightsLoader`` (no
engine).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="the module and the loader are vLLM's")

from engine_agent.reload.coverage import CoverageLedger
from engine_agent.reload.index import ModelIndex, build_index
from engine_agent.reload.inventory import CHECKPOINT, DERIVED, RUNTIME
from engine_agent.reload.modelwise import LoadRouter


class _Mlp(nn.Module):
    def __init__(self) -> None:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.activation import XIELU

        super().__init__()
        with set_current_vllm_config(VllmConfig()):  # a CustomOp reads it when built
            self.act_fn = XIELU(dtype=torch.float32)
        # a module with no parameter of its own whose persistent buffer the checkpoint writes
        # (Gemma 4's decoder layer and its ``layer_scalar``)
        self.layer = nn.Module()
        self.layer.register_buffer("layer_scalar", torch.ones(1))
        # a non-persistent buffer is never in a checkpoint: runtime state
        self.table = nn.Module()
        self.table.register_buffer("cache", torch.arange(4.0), persistent=False)


def _model() -> nn.Module:
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading
    from vllm.model_executor.models.utils import AutoWeightsLoader

    model = _Mlp()
    record_metadata_for_reloading(model)  # as vLLM does right after building the model

    def load_weights(weights: Any) -> set[str]:
        return AutoWeightsLoader(model).load_weights(weights)

    model.load_weights = load_weights  # type: ignore[method-assign]
    return model


def _checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"alpha_p": [1], "alpha_n": [1], "beta": [], "eps": []}
    tensors = {f"act_fn.{n}": torch.randn(s, generator=g) for n, s in shapes.items()}
    return tensors | {"layer.layer_scalar": torch.randn([1], generator=g)}


def _router(index: ModelIndex) -> LoadRouter:
    """A load router over ``index`` for a full update (every indexed module required)."""
    return LoadRouter(
        index, CoverageLedger(index.required()), torch.device("cpu"), torch.float32, lambda: None
    )


def test_persistent_buffers_of_a_module_with_checkpoint_parameters_are_checkpoint_tensors() -> None:
    index = build_index(_model())
    assert set(index.entries["act_fn"].templates) == {"alpha_p", "alpha_n", "beta", "eps"}
    assert "table" not in index.entries
    items = index.inventory().items
    assert items["act_fn.beta"].kind == CHECKPOINT
    assert items["act_fn.eps"].kind == CHECKPOINT
    assert items["table.cache"].kind == RUNTIME
    assert index.inventory().unsupported(index.entries) == []


def test_an_update_writes_the_buffers_in_place_and_equals_a_cold_load() -> None:
    model = _model()
    model.load_weights(_checkpoint(0).items())  # the engine's first (cold) load: A
    index = build_index(model)
    addresses = {n: t.data_ptr() for n, t in index.entries["act_fn"].live_tensors().items()}
    router = _router(index)
    b = _checkpoint(1)
    router.dry_run((n, t.shape, t.dtype) for n, t in b.items())
    assert model.act_fn.beta.device.type == "cpu"  # the dry run wrote nothing, and left no proxy
    router.load(b.items())
    assert router.processed == {"act_fn", "layer"}
    assert router.ledger.is_complete("act_fn")

    cold = _model()
    cold.load_weights(b.items())
    x = torch.linspace(-3, 3, 64)
    assert torch.equal(model.act_fn(x), cold.act_fn(x))
    for name, tensor in index.entries["act_fn"].live_tensors().items():
        assert torch.equal(tensor, b[f"act_fn.{name}"]), name
        assert tensor.data_ptr() == addresses[name], f"{name} moved"


def test_a_full_update_without_the_buffers_is_incomplete() -> None:
    model = _model()
    model.load_weights(_checkpoint(0).items())
    before = model.act_fn.beta.clone()
    index = build_index(model)
    router = _router(index)
    router.load((n, t) for n, t in _checkpoint(1).items() if not n.endswith(("beta", "eps")))
    assert router.processed == {"layer"}
    assert not router.ledger.is_complete("act_fn")
    assert torch.equal(model.act_fn.beta, before)


def test_a_buffer_registered_after_the_build_is_derived_state() -> None:
    """What post-load processing registers (a quant method's gather copy, ``zero_bias``) is not
    a checkpoint tensor, persistent or not."""
    model = _model()
    model.act_fn.register_buffer("zero_bias", torch.zeros(1))  # after the record
    index = build_index(model)
    assert "zero_bias" not in index.entries["act_fn"].templates
    assert index.inventory().items["act_fn.zero_bias"].kind == DERIVED


def test_a_persistent_buffer_of_a_module_without_parameters_is_a_checkpoint_tensor() -> None:
    index = build_index(_model())
    assert set(index.entries["layer"].templates) == {"layer_scalar"}
    assert index.inventory().items["layer.layer_scalar"].kind == CHECKPOINT


def test_an_update_of_a_parameterless_module_buffer_equals_a_cold_load() -> None:
    """Gemma 4's ``layer_scalar``: before the fix the check run copied a meta tensor into the
    live buffer and the update was refused (``Cannot copy out of meta tensor``)."""
    model = _model()
    model.load_weights(_checkpoint(0).items())
    index = build_index(model)
    address = model.layer.layer_scalar.data_ptr()
    router = _router(index)
    b = _checkpoint(1)
    router.dry_run((n, t.shape, t.dtype) for n, t in b.items())
    router.load(b.items())
    assert router.processed == {"act_fn", "layer"}
    cold = _model()
    cold.load_weights(b.items())
    assert torch.equal(model.layer.layer_scalar, cold.layer.layer_scalar)
    assert model.layer.layer_scalar.data_ptr() == address


def test_a_full_update_without_a_parameterless_module_buffer_is_incomplete() -> None:
    """The live value came from the earlier checkpoint; an update that does not write it
    cannot equal a cold load of its own checkpoint, so it must not commit."""
    model = _model()
    model.load_weights(_checkpoint(0).items())
    before = model.layer.layer_scalar.clone()
    index = build_index(model)
    router = _router(index)
    router.load((n, t) for n, t in _checkpoint(1).items() if n != "layer.layer_scalar")
    assert router.processed == {"act_fn"}
    assert not router.ledger.is_complete("layer")
    assert torch.equal(model.layer.layer_scalar, before)


def test_a_checkpoint_tensor_reaching_an_unindexed_live_buffer_is_named_as_such() -> None:
    """The loader offers a buffer registered after the build (derived state) by name; in the
    check run the meta tensor reaches the live buffer. That is an unaccounted write, not a
    shape mismatch, and the refusal says so and names the tensor."""
    from engine_agent.errors import LoaderUnsupported

    model = _model()
    model.load_weights(_checkpoint(0).items())
    model.act_fn.register_buffer("zero_bias", torch.zeros(1))  # after the record
    index = build_index(model)
    router = _router(index)
    b = _checkpoint(1) | {"act_fn.zero_bias": torch.ones(1)}
    with pytest.raises(LoaderUnsupported, match="never materialised") as refused:
        router.dry_run((n, t.shape, t.dtype) for n, t in b.items())
    assert refused.value.field == "act_fn.zero_bias"
    assert torch.equal(model.act_fn.zero_bias, torch.zeros(1))
