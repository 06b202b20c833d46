"""Which parameters are checkpoint parameters, and how they load (engine_agent/reload/index.py,
modelwise.py, inventory.py).

A checkpoint parameter is one the model held when it was built: what vLLM's build-time
recorder (``record_metadata_for_reloading``) saw, plus the parameters that recorder leaves out
by name (``SKIP_TENSORS``: biases, the routing ``e_score_correction_bias``), whether or not
they carry a ``weight_loader``. Only what post-load processing creates later is derived state.
Issue 26 items 6 and 7: loader-less biases (every LayerNorm with a bias; every
``topk_method: noaux_tc`` model's score correction bias) were derived state with no refresher,
so every full update of GPT-2, OPT, DeepSeek-V3 or Kimi-K2 was refused at ``begin``.

Loading (:class:`LoadRouter`): a parameter two modules hold (MiniMax-M2's routing bias, item 5)
and a sparse patch through a loader that computes (Plamo3, LongCat-Flash, Mamba2; item 1).

Plain torch modules, recorded by vLLM's own recorder (no engine).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("vllm", reason="the index reads vLLM's reload metadata")

from engine_agent.reload.index import build_index
from engine_agent.reload.inventory import CHECKPOINT, DERIVED


class _Model(nn.Module):
    """A LayerNorm with a bias, a router whose loader-less bias its experts also hold, and
    two weight-only (RMS-style) norms."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)  # weight and bias, neither with a weight_loader
        self.q_norm, self.final_norm = nn.Module(), nn.Module()
        self.q_norm.weight = nn.Parameter(torch.randn(8))
        self.final_norm.weight = nn.Parameter(torch.randn(8))
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.randn(4, 8))
        self.gate.e_score_correction_bias = nn.Parameter(torch.randn(4))
        self.experts = nn.Module()
        self.experts.w13_weight = nn.Parameter(torch.randn(4, 8))
        # as vLLM's FusedMoE keeps the gate's bias: the same parameter object
        self.experts.e_score_correction_bias = self.gate.e_score_correction_bias


def _recorded(norm_loader: Any = None) -> _Model:
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    model = _Model()
    if norm_loader is not None:  # set while building, as vLLM models set their loaders
        model.final_norm.weight.weight_loader = norm_loader
    record_metadata_for_reloading(model)  # as vLLM does right after building the model
    return model


def test_loader_less_biases_are_checkpoint_parameters() -> None:
    model = _recorded()
    index = build_index(model)
    assert set(index.entries["norm"].templates) == {"weight", "bias"}
    assert set(index.entries["gate"].templates) == {"weight", "e_score_correction_bias"}
    items = index.inventory().items
    assert items["norm.bias"].kind == CHECKPOINT
    assert items["gate.e_score_correction_bias"].kind == CHECKPOINT
    # nothing of the model is derived state without a refresher: a full update may begin
    assert index.inventory().unsupported(index.entries) == []


def test_a_parameter_shared_by_two_modules_is_loaded_once_and_orders_their_processing() -> None:
    index = build_index(_recorded())
    assert "e_score_correction_bias" not in index.entries["experts"].templates
    items = index.inventory().items
    assert items["experts.e_score_correction_bias"].kind == CHECKPOINT
    assert items["experts.e_score_correction_bias"].sources == {"gate"}
    assert index.owners_of("experts") == {"gate"}
    assert index.owners_of("gate") == set()


def test_a_parameter_created_after_the_build_is_derived_state() -> None:
    """What post-load processing adds (a packed copy) is not a checkpoint parameter: nothing
    may write it from a checkpoint, and updating its module needs a refresher for it."""
    model = _recorded()
    model.norm.packed = nn.Parameter(model.norm.weight.detach().clone())  # after the record
    index = build_index(model)
    assert "packed" not in index.entries["norm"].templates
    item = index.inventory().items["norm.packed"]
    assert item.kind == DERIVED and item.refresher is None
    assert [i.name for i in index.inventory().unsupported({"norm"})] == ["norm.packed"]


# -- loading: a shared parameter, a transforming loader (LoadRouter on plain modules) ---------


class _SeesBias:
    """Post-load step of the experts (a stand-in for their kernel-format prepack): records the
    routing bias it reads, as a router kernel built at post-load time would."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, layer: nn.Module) -> None:
        self.seen.append(layer.e_score_correction_bias.detach().clone())


def _with_loading(model: nn.Module) -> nn.Module:
    """Give ``model`` vLLM's loading convention: each parameter's loader, else the default."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    def load_weights(weights: Any) -> set[str]:
        params = dict(model.named_parameters())
        for name, tensor in weights:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        return set()

    model.load_weights = load_weights  # type: ignore[method-assign]
    return model


def _router(model: nn.Module, sparse: bool = False) -> Any:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from engine_agent.reload.coverage import CoverageLedger
    from engine_agent.reload.modelwise import LoadRouter

    class Method(QuantizeMethodBase):
        def __init__(self) -> None:
            self.step = _SeesBias()

        def create_weights(self, *args: Any, **kwargs: Any) -> None: ...

        def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            raise NotImplementedError

        def process_weights_after_loading(self, layer: nn.Module) -> None:
            self.step(layer)

    if hasattr(model, "experts"):
        model.experts.quant_method = Method()
    index = build_index(model)
    if sparse:
        optional = frozenset((e.name, p) for e in index.entries.values() for p in e.templates)
        ledger = CoverageLedger({}, optional)
    else:
        ledger = CoverageLedger(index.required())
    return LoadRouter(index, ledger, torch.device("cpu"), torch.float32, lambda: None)


def test_a_module_sharing_a_parameter_is_processed_after_its_owner_on_the_real_parameter() -> None:
    """MiniMax-M2 / DeepSeek-V3: the experts hold their block's (gate's) routing bias. Before:
    the experts were processed with the load's meta guard in the bias's slot, and copying it
    back raised "Cannot copy out of meta tensor" after live writes (issue 26, item 5)."""
    model = _with_loading(_recorded())
    router = _router(model)
    new = {name: torch.randn_like(p) for name, p in model.named_parameters()}
    # the experts arrive first: they must wait for the bias they read
    first = ["experts.w13_weight", "norm.weight", "norm.bias", "gate.weight"]
    rest = [n for n in new if n not in first]
    assert rest[-1] == "gate.e_score_correction_bias"
    router.load([(n, new[n]) for n in [*first, *rest]])
    assert router.processed == {"norm", "q_norm", "final_norm", "gate", "experts"}
    assert model.experts.e_score_correction_bias is model.gate.e_score_correction_bias
    for name, param in model.named_parameters():
        assert torch.equal(param, new[name]), name
    (seen,) = model.experts.quant_method.step.seen
    assert torch.equal(seen, new["gate.e_score_correction_bias"])


def test_updating_a_shared_parameter_without_the_module_sharing_it_is_refused_at_begin() -> None:
    from engine_agent.errors import DerivedStateUnsupported
    from engine_agent.reload.coverage import CoverageLedger
    from engine_agent.reload.modelwise import LoadRouter

    model = _with_loading(_recorded())
    index = build_index(model)
    with pytest.raises(DerivedStateUnsupported, match="experts"):
        LoadRouter(
            index,
            CoverageLedger(index.required(["gate"])),
            torch.device("cpu"),
            torch.float32,
            lambda: None,
        )


@pytest.mark.parametrize(
    "transform",
    [lambda x: x + 1, lambda x: x + 0.2, lambda x: x * 1.5, lambda x: -torch.exp(x.float())],
    ids=["plus-1", "plus-0.2", "times-1.5", "minus-exp"],
)
def test_a_sparse_patch_through_a_transforming_loader_is_refused_before_any_write(
    transform: Any,
) -> None:
    """Plamo3 (``x + offset``), LongCat-Flash (``x * scale``), Mamba2 (``-exp(x)``): the cold
    engine holds what the loader computes. Before: the raw value was written and committed
    (``+ 0.2``), or the coordinate pass raised ``IndexError`` (``+ 1``) (issue 26, item 1)."""
    from vllm.model_executor.model_loader.weight_utils import (
        composed_weight_loader,
        default_weight_loader,
    )

    from engine_agent.errors import SparseRefused

    model = _recorded(composed_weight_loader(default_weight_loader, transform))
    router = _router(_with_loading(model), sparse=True)
    before = model.final_norm.weight.detach().clone()
    patch = ("final_norm.weight", torch.Size([8]), torch.tensor([0, 3]), torch.tensor([0.5, 0.25]))
    with pytest.raises(SparseRefused, match="composed_weight_loader"):
        router.apply_sparse([patch])
    assert torch.equal(model.final_norm.weight, before)
    # a norm whose loader only copies is patched as before
    router.apply_sparse(
        [("q_norm.weight", torch.Size([8]), torch.tensor([1]), torch.tensor([0.75]))]
    )
    assert float(model.q_norm.weight[1]) == 0.75
