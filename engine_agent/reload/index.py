"""The rank's model index: which modules the checkpoint fills, and the shards each must receive.

:func:`build_index` walks one rank's model once, when the engine first needs it. For every
module with checkpoint-format parameters (vLLM records them as meta tensors at model init,
``get_layerwise_info(m).restore_metadata``) it keeps each parameter's checkpoint shape and
weight loader (its *template*), and from the module type its shard selectors: ``q/k/v`` for
``QKVParallelLinear``, ``0..n-1`` for ``MergedColumnParallelLinear``, ``e<id>:w1|w2|w3`` for the
experts this rank owns, ``*`` otherwise. That is the rank's required shard set, the set the
coverage ledger (:mod:`.coverage`) must see arrive before a module counts as complete. The
index also names each module's derived-state refreshers (:mod:`.derived`), classifies every
tensor the kernels read (:mod:`.inventory`) and maps an update's scope onto module names.

Invariants:
    * The index describes the model and never changes it: it holds the live modules and meta
      templates only; the router (:mod:`.modelwise`) swaps the templates in for a load.
    * A checkpoint parameter is a parameter the model had when it was built (vLLM's build-time
      record, with its deliberate omissions undone, :func:`_templates`); parameters created
      later by post-load processing are derived state. The persistent buffers the model had
      when it was built are checkpoint tensors too, on any module: vLLM's ``AutoWeightsLoader``
      loads them by name as ``state_dict`` saves them (:func:`_checkpoint_buffers`).

Limitations:
    1. A parameter held by several modules (tied embeddings; the routing bias of MiniMax-M2's
       block or DeepSeek-V3's gate, also held by the experts) is indexed once, under the first
       module that holds it; every other holder is a *sharer* (:attr:`ModelIndex.sharers`),
       which the router must reprocess or reload with the owner.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from engine_agent.errors import UnknownTensor
from engine_agent.reload.coverage import WHOLE, ShardKey
from engine_agent.reload.derived import DerivedRefresher, find_refreshers
from engine_agent.reload.identity import StorageRecord, kernel_tag, storage_record
from engine_agent.reload.inventory import _RUNTIME_ATTRS, Inventory, build_inventory

__all__ = ["ModelIndex", "ModuleEntry", "build_index", "live_tensor"]

#: Parameters vLLM itself never loads through a weight loader (kept in sync with
#: ``vllm.model_executor.model_loader.reload.meta.SKIP_LOAD_TENSORS``).
_NEVER_LOADED = frozenset(
    {
        "_expert_map",
        "expert_mask",
        "expert_global_to_physical",
        "expert_physical_to_global",
        "expert_local_to_global",
    }
)


@dataclass(eq=False)
class ModuleEntry:
    """One module with checkpoint-format parameters, as seen by this rank."""

    name: str
    module: nn.Module
    #: parameter name -> meta template (checkpoint shape, class and loader attributes).
    templates: dict[str, torch.Tensor]
    #: "qkv" | "merged" | "moe" | "plain"
    kind: str
    shard_ids: tuple[str, ...] = ()
    local_experts: frozenset[int] = frozenset()
    required: frozenset[ShardKey] = frozenset()

    def keys_for_call(self, param: str, args: inspect.BoundArguments) -> list[ShardKey]:
        """The shard keys one weight-loader call writes (empty: not owned by this rank)."""
        arguments = args.arguments
        if self.kind in ("qkv", "merged") and param in self.templates:
            shard = arguments.get("loaded_shard_id")
            if shard is None:
                selected: Iterable[str] = self.shard_ids
            elif isinstance(shard, tuple | list):
                selected = [str(s) for s in shard]
            else:
                selected = [str(shard)]
            return [ShardKey(self.name, param, s) for s in selected]
        if self.kind == "moe" and param.startswith(("w13_", "w2_")):
            shard_id = str(arguments.get("shard_id"))
            loaded = arguments.get("loaded_weight")
            full_load = isinstance(loaded, torch.Tensor) and loaded.dim() == 3
            experts = (
                sorted(self.local_experts)
                if full_load
                else [int(arguments["expert_id"])]
                if int(arguments["expert_id"]) in self.local_experts
                else []
            )
            return [ShardKey(self.name, param, f"e{e}:{shard_id}") for e in experts]
        return [ShardKey(self.name, param, WHOLE)]

    def live_tensors(self) -> dict[str, torch.Tensor]:
        params = {k: v for k, v in self.module._parameters.items() if v is not None}
        buffers = {k: v for k, v in self.module._buffers.items() if v is not None}
        return params | buffers


@dataclass(eq=False)
class ModelIndex:
    """Every loadable module of one rank's model, plus its derived-state refreshers."""

    model: nn.Module
    entries: dict[str, ModuleEntry]
    #: source module name -> refreshers to run after that module is processed.
    refreshers: dict[str, list[DerivedRefresher]]
    #: modules whose derived state no refresher covers: updating them fails closed.
    unsupported: dict[str, str] = field(default_factory=dict)
    #: owner module name -> (holder name, holder, parameter name) of every *other* module
    #: holding one of the owner's parameter objects (tied embeddings: ``lm_head``).
    sharers: dict[str, list[tuple[str, nn.Module, str]]] = field(default_factory=dict)

    def owners_of(self, name: str) -> set[str]:
        """Indexed modules owning a parameter that module ``name`` also holds."""
        return {
            owner
            for owner, holders in self.sharers.items()
            if any(holder == name for holder, _module, _param in holders)
        }

    def holders(self) -> dict[int, str]:
        """``id(live tensor) -> owner module name`` for every checkpoint parameter or buffer."""
        out: dict[int, str] = {}
        for name, entry in self.entries.items():
            for pname in entry.templates:
                live = live_tensor(entry.module, pname)
                if live is not None:
                    out[id(live)] = name
        return out

    def inventory(self) -> Inventory:
        """Classify every tensor and kernel object the kernels read (see :mod:`.inventory`)."""
        derived: dict[str, tuple[str, frozenset[str]]] = {}
        for source, refreshers in self.refreshers.items():
            for refresher in refreshers:
                label = f"{type(refresher).__name__}:{refresher.name}"
                for qualified in refresher.tensors():
                    old = derived.get(qualified, (label, frozenset()))[1]
                    derived[qualified] = (label, old | {source})
        post_load_ok = {n: _has_quant_method(m) for n, m in self.model.named_modules()}
        return build_inventory(self.model, self.entries, self.holders(), derived, post_load_ok)

    def required(self, modules: Iterable[str] | None = None) -> dict[str, frozenset[ShardKey]]:
        names = self.entries.keys() if modules is None else modules
        return {name: self.entries[name].required for name in names}

    def kernel_visible(self) -> dict[str, torch.Tensor]:
        """Every tensor a kernel reads, by name: parameters, buffers, registered derived ones."""
        tensors: dict[str, torch.Tensor] = {
            name: t
            for name, t in self.model.named_parameters(remove_duplicate=False)
            if t.device.type != "meta"
        }
        tensors |= {
            name: t
            for name, t in self.model.named_buffers(remove_duplicate=False)
            if t.device.type != "meta"
        }
        for refreshers in self.refreshers.values():
            for refresher in refreshers:
                tensors |= refresher.tensors()
        return tensors

    def storage_snapshot(self) -> dict[str, StorageRecord]:
        return {name: storage_record(t) for name, t in self.kernel_visible().items()}

    def kernel_snapshot(self) -> dict[str, str]:
        return {name: kernel_tag(m) for name, m in self.model.named_modules()}

    def resolve_scope(self, scope: Iterable[str]) -> set[str]:
        """Map checkpoint names or name prefixes (ending in ".") to indexed module names.

        Raises:
            UnknownTensor: a scope entry matches no module of this model.
        """
        packed = getattr(self.model, "packed_modules_mapping", {}) or {}
        fused_of = {part: fused for fused, parts in packed.items() for part in parts}
        modules: set[str] = set()
        for item in scope:
            found = self._resolve_one(item, fused_of)
            if not found:
                raise UnknownTensor(
                    f"scope entry {item!r} matches no parameter of this model; use checkpoint "
                    "tensor names (model.layers.0.mlp.down_proj.weight) or prefixes ending "
                    "in '.' (model.layers.0.mlp.)",
                    field="scope",
                )
            modules |= found
        return modules

    def _resolve_one(self, item: str, fused_of: Mapping[str, str]) -> set[str]:
        if item.endswith("."):  # a prefix: the module itself ("model.norm.") or below it
            return {n for n in self.entries if f"{n}.".startswith(item)}
        path, _, _param = item.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        candidates = [path, f"{parent}.{fused_of[leaf]}" if leaf in fused_of else ""]
        for candidate in candidates:
            if candidate in self.entries:
                return {candidate}
        if ".experts." in path:
            owner = path.split(".experts.", 1)[0] + ".experts"
            return {n for n, e in self.entries.items() if n.startswith(owner) and e.kind == "moe"}
        return set()


def _module_kind(module: nn.Module) -> tuple[str, tuple[str, ...]]:
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        QKVParallelLinear,
    )

    if isinstance(module, QKVParallelLinear):
        return "qkv", ("q", "k", "v")
    if isinstance(module, MergedColumnParallelLinear):
        return "merged", tuple(str(i) for i in range(len(module.output_sizes)))
    if hasattr(module, "_map_global_expert_id_to_local_expert_id"):
        return "moe", ()
    return "plain", ()


def _local_experts(module: nn.Module) -> frozenset[int]:
    moe_config = getattr(module, "moe_config", None)
    total = int(
        getattr(moe_config, "num_logical_experts", 0) or getattr(module, "global_num_experts", 0)
    )
    mapper = module._map_global_expert_id_to_local_expert_id
    return frozenset(e for e in range(total) if int(mapper(e)) != -1)  # type: ignore[operator]


def _templates(module: nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint parameters of ``module``: every parameter it held when the model was built.

    vLLM records the parameters of every module right after the model is built, before the
    checkpoint is loaded (``record_metadata_for_reloading``), so what it recorded is what a
    cold load fills. Its recorder leaves out some names on purpose (``SKIP_TENSORS``: a
    ``bias`` is built after ``create_weights``, the routing ``e_score_correction_bias`` is
    read in place, the expert maps are never loaded); those parameters exist from the start
    and the checkpoint writes them all the same — through their own ``weight_loader`` or,
    without one, the model's default loader. Undoing that filter, instead of asking for a
    ``weight_loader`` attribute, is what makes a loader-less parameter (a LayerNorm's bias,
    DeepSeek-V3's score correction bias) a checkpoint parameter and not derived state with no
    refresher (issue 26, items 6 and 7). Parameters created later, by post-load processing,
    are in neither set: they are derived state.
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    restore_params, _ = get_layerwise_info(module).restore_metadata
    templates = {
        name: restore_layer_refs(to_meta_tensor(meta), module)
        for name, meta in restore_params.items()
        if name not in _NEVER_LOADED
    }
    unrecorded = _unrecorded_at_build()
    for name, live in module._parameters.items():
        if name in templates or live is None or name in _NEVER_LOADED or live.numel() == 0:
            continue
        if name in unrecorded or hasattr(live, "weight_loader"):
            templates[name] = to_meta_tensor(live)
    return templates | _checkpoint_buffers(module)


def _checkpoint_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of ``module`` a cold load writes from the checkpoint.

    A cold load writes what the checkpoint holds, and a checkpoint holds what ``state_dict``
    saves: every persistent buffer, on whichever module it sits. vLLM's ``AutoWeightsLoader``
    walks the module tree the same way and offers every module's persistent buffers by name
    (``_add_loadable_non_param_tensors``), whether or not the module has parameters: Apertus's
    XIELU keeps ``beta``/``eps`` beside its ``alpha_p``/``alpha_n`` parameters, and Gemma 4's
    decoder layer, a module with no parameter of its own, keeps its ``layer_scalar``. Counting
    only the buffers of modules with parameters left ``layer_scalar`` outside the index, so the
    check run's meta tensor reached the live buffer and every full and partial Gemma 4 update
    was refused (issue 26). A buffer that is a checkpoint tensor is required like a parameter:
    an update whose checkpoint does not write it is incomplete and refused, as it must be when
    the live value came from an earlier checkpoint. As for parameters, only buffers the module
    had when it was built count (vLLM's build-time record): one a post-load step registers (a
    quant method's gather copies, ``zero_bias``) is derived state. A non-persistent buffer is
    never in a checkpoint (mamba's ``conv_weights`` is a non-persistent view of
    ``conv1d.weight``; Gemma's ``normalizer``).
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

    _, built = get_layerwise_info(module).restore_metadata
    skipped = module._non_persistent_buffers_set | _NEVER_LOADED | _RUNTIME_ATTRS
    return {
        name: to_meta_tensor(live)
        for name, live in module._buffers.items()
        if name in built and live is not None and name not in skipped and live.numel() > 0
    }


def live_tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    """The live parameter or (checkpoint) buffer ``name`` of ``module``."""
    param = module._parameters.get(name)
    return param if param is not None else module._buffers.get(name)


def _unrecorded_at_build() -> frozenset[str]:
    """Parameter names vLLM's build-time recorder leaves out although the model has them."""
    try:
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS
    except ImportError:  # a vLLM without the set: the names 0.32.0 skips
        return frozenset({"bias", "e_score_correction_bias"})
    return frozenset(SKIP_TENSORS)


def _has_quant_method(module: nn.Module) -> bool:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    return isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)


def build_index(model: nn.Module) -> ModelIndex:
    """Index every loadable module of ``model`` on this rank (see the module docstring)."""
    entries: dict[str, ModuleEntry] = {}
    owner_of: dict[int, str] = {}
    sharers: dict[str, list[tuple[str, nn.Module, str]]] = {}
    for name, module in model.named_modules():
        templates = _templates(module)
        for pname, live in module._parameters.items():
            if live is None:
                continue
            if id(live) in owner_of:  # tied with an earlier module: that one loads it
                templates.pop(pname, None)
                sharers.setdefault(owner_of[id(live)], []).append((name, module, pname))
            elif pname in templates:
                owner_of[id(live)] = name
        if not templates:
            continue
        kind, shard_ids = _module_kind(module)
        entry = ModuleEntry(name, module, templates, kind, shard_ids)
        if kind == "moe":
            entry.local_experts = _local_experts(module)
        entry.required = frozenset(_required_keys(entry))
        entries[name] = entry
    refreshers, unsupported = find_refreshers(model, {id(e.module): n for n, e in entries.items()})
    return ModelIndex(model, entries, refreshers, unsupported, sharers)


def _required_keys(entry: ModuleEntry) -> Iterator[ShardKey]:
    for param in entry.templates:
        if entry.kind in ("qkv", "merged"):
            yield from (ShardKey(entry.name, param, s) for s in entry.shard_ids)
        elif entry.kind == "moe" and param.startswith("w13_"):
            for e in sorted(entry.local_experts):
                yield ShardKey(entry.name, param, f"e{e}:w1")
                yield ShardKey(entry.name, param, f"e{e}:w3")
        elif entry.kind == "moe" and param.startswith("w2_"):
            yield from (
                ShardKey(entry.name, param, f"e{e}:w2") for e in sorted(entry.local_experts)
            )
        else:
            yield ShardKey(entry.name, param, WHOLE)
