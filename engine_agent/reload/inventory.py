"""Inventory of every tensor a rank's kernels read (issue 10, A).

Parameters and buffers are not all a kernel reads. vLLM keeps kernel state in plain attributes
(MLA ``W_UK_T``/``W_UV`` on the layer or its ``impl``, the KV cache), and on CPU the GEMM kernel
of a linear or LM head is a closure ``layer.cpu_linear`` that may hold its own packed copy of the
weight (oneDNN handle, sgl-kernel packed tensor; vllm-on-cpu.md §9). A parameter object may also
be held by several modules (tied embeddings: ``lm_head.weight is embed_tokens.weight``), and
every holder's kernel state is derived from it.

At ``begin`` :func:`build_inventory` walks every module and classifies each tensor or kernel
object it owns:

* ``checkpoint`` — a parameter the checkpoint writes (through the index), with every module
  that holds it;
* ``derived`` — computed from checkpoint parameters, with the refresher that rebuilds it: the
  holder's own post-load step (``post_load:<module>``) or a registered refresher
  (:mod:`engine_agent.reload.derived`); ``None`` when nothing rebuilds it, and then updating
  any of its sources fails closed at ``begin``, naming module and attribute;
* ``runtime`` — weight-independent state (KV cache, rotary tables, unquantized attention scales).

At ``finish`` :meth:`Inventory.compare` checks every item: tensors keep address, offset, shape,
stride and dtype; a derived item whose sources were updated in this session must have been
rebuilt in it (:meth:`Inventory.rebuilt_since`), any other kernel object must be the very object
seen at ``begin``.

Limitations:
    1. Plain tensor attributes of modules that neither hold checkpoint parameters nor reference
       a module that does are taken as runtime state (rotary caches and the like).
    2. Attention q/k/v/prob scales are runtime state: quantized KV caches (whose scales a
       checkpoint writes) are not supported.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine_agent.reload.identity import StorageRecord, storage_record

__all__ = ["CHECKPOINT", "DERIVED", "RUNTIME", "Inventory", "Item", "build_inventory"]

CHECKPOINT, DERIVED, RUNTIME = "checkpoint", "derived", "runtime"

#: Plain attributes vLLM layers keep that are weight-independent runtime state.
_RUNTIME_ATTRS = frozenset(
    {
        "kv_cache",
        "_k_scale",
        "_v_scale",
        "_q_scale",
        "_prob_scale",
        "_k_scale_cpu",
        "_v_scale_cpu",
        "_q_scale_cpu",
        "cos_sin_cache",
        # expert routing maps (never loaded from a checkpoint; index._NEVER_LOADED)
        "_expert_map",
        "expert_mask",
        "expert_global_to_physical",
        "expert_physical_to_global",
        "expert_local_to_global",
        # MambaMixer2's ReplaySSM ring trackers: per-cache-block scheduling state (int32),
        # allocated with the KV cache and shared by a cache group's mixers
        "_replayssm_ring_start",
        "_replayssm_prev_num_accepted",
        "_replayssm_prev_query_len",
        # Gemma 3n's AltUp router scale: hidden_size ** -1, a constant of the config that no
        # weight changes (a non-persistent buffer beside the router's parameters)
        "router_input_scale",
    }
)
#: Callable attributes that are kernels: an opaque object in their closure is kernel state.
_KERNEL_CALLABLES = frozenset({"cpu_linear"})
_PRIMITIVES = (int, float, str, bool, bytes, type(None))


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor or kernel object a kernel reads."""

    #: Qualified name: ``<module>.<attribute>`` (``<module>.cpu_linear`` for a GEMM closure).
    name: str
    #: Name of the module that holds it.
    module: str
    #: ``checkpoint`` | ``derived`` | ``runtime``.
    kind: str
    #: Indexed modules whose checkpoint parameters it is, or is derived from.
    sources: frozenset[str]
    #: What rebuilds it (derived only): ``post_load:<module>`` or ``<Refresher>:<layer>``.
    refresher: str | None
    #: Storage identity at ``begin`` (tensors only).
    record: StorageRecord | None
    #: The object seen at ``begin`` (kernel objects only), weakly held.
    ref: Any = None


@dataclass(eq=False)
class Inventory:
    """Every item of one rank, classified; built at ``begin``."""

    items: dict[str, Item]

    def unsupported(self, modules: Iterable[str]) -> list[Item]:
        """Derived items with no refresher whose sources include any of ``modules``."""
        wanted = set(modules)
        return [
            i
            for i in self.items.values()
            if i.kind == DERIVED and i.refresher is None and i.sources & wanted
        ]

    def counts(self) -> dict[str, int]:
        out = {CHECKPOINT: 0, DERIVED: 0, RUNTIME: 0}
        for item in self.items.values():
            out[item.kind] += 1
        return out

    def compare(self, model: nn.Module, touched: set[str], rebuilt: set[str]) -> list[str]:
        """Every item that moved, vanished, or is derived from ``touched`` and was not rebuilt.

        Args:
            model: the rank's model, now.
            touched: indexed modules whose checkpoint parameters this session changed.
            rebuilt: names of derived items rebuilt in this session.
        """
        now = _collect(model)
        problems: list[str] = []
        for name, item in sorted(self.items.items()):
            current = now.get(name)
            stale = item.kind == DERIVED and bool(item.sources & touched)
            if stale and name not in rebuilt:
                problems.append(
                    f"{name}: derived from {sorted(item.sources & touched)} updated in this "
                    f"session but not rebuilt (refresher {item.refresher})"
                )
                continue
            if current is None:
                problems.append(f"{name}: disappeared since begin")
                continue
            if item.record is not None:
                if not isinstance(current, torch.Tensor):
                    problems.append(f"{name}: is no longer a tensor")
                elif (new := storage_record(current)) != item.record:
                    problems.append(
                        f"{name}: storage changed {item.record.describe()} -> {new.describe()}"
                    )
            elif not stale and item.ref is not None and item.ref() is not current:
                problems.append(f"{name}: kernel object replaced, but none of its sources changed")
        return problems

    def rebuilt_since(self, name: str, module: nn.Module) -> list[str]:
        """Kernel objects of ``module`` (named ``name``) that are not the ones seen at ``begin``."""
        now = {f"{name}.{k}" if name else k: v for k, v in _owned(module).items()}
        return [
            qualified
            for qualified, item in self.items.items()
            if item.module == name and item.ref is not None and item.ref() is not now.get(qualified)
        ]


def build_inventory(
    model: nn.Module,
    entries: Mapping[str, Any],
    holders: Mapping[int, str],
    derived: Mapping[str, tuple[str, frozenset[str]]],
    post_load_ok: Mapping[str, bool],
) -> Inventory:
    """Classify every tensor and kernel object of ``model``.

    Args:
        model: the rank's model.
        entries: indexed module name -> ``ModuleEntry`` (its ``templates`` are the
            checkpoint parameters).
        holders: ``id(parameter) -> indexed module name`` for every checkpoint parameter.
        derived: qualified tensor name -> ``(refresher, sources)`` from registered refreshers.
        post_load_ok: module name -> whether its own post-load step can be re-run (it has a
            vLLM quant method) — the refresher of its kernel objects.
    """
    indexed_ids = {id(e.module): n for n, e in entries.items()}
    aliased = _checkpoint_storages(model, holders)
    items: dict[str, Item] = {}
    for mname, module in model.named_modules():
        own_sources = {holders[id(p)] for p in module._parameters.values() if id(p) in holders}
        if id(module) in indexed_ids:
            own_sources.add(indexed_ids[id(module)])
        referenced = {
            indexed_ids[id(v)]
            for v in vars(module).values()
            if isinstance(v, nn.Module) and id(v) in indexed_ids
        }
        sources = frozenset(own_sources | referenced)
        post_load = f"post_load:{mname}" if post_load_ok.get(mname) else None
        for attr, obj in _owned(module).items():
            qualified = f"{mname}.{attr}" if mname else attr
            record = storage_record(obj) if isinstance(obj, torch.Tensor) else None
            ref = None if record is not None else _weak(obj)
            storage = _storage_key(obj) if isinstance(obj, torch.Tensor) else None
            viewed = None if storage is None else aliased.get(storage)
            if qualified in derived:
                refresher, from_ = derived[qualified]
                items[qualified] = Item(qualified, mname, DERIVED, from_, refresher, record, ref)
            elif isinstance(obj, torch.Tensor) and id(obj) in holders:
                holder = holders[id(obj)]
                items[qualified] = Item(
                    qualified, mname, CHECKPOINT, frozenset({holder}), None, record
                )
            elif viewed is not None:
                # A view of a checkpoint parameter's storage (mamba's ``conv_weights``, a
                # reshaped ``conv1d.weight``): it reads the parameter's bytes, which the update
                # writes in place; the parameter's own identity check covers a moved storage.
                items[qualified] = Item(
                    qualified, mname, CHECKPOINT, frozenset({viewed}), None, record
                )
            elif any(part in _RUNTIME_ATTRS for part in attr.split(".")) or not sources:
                items[qualified] = Item(qualified, mname, RUNTIME, frozenset(), None, record, ref)
            else:
                rebuilt_by = post_load if attr in _KERNEL_CALLABLES else None
                items[qualified] = Item(qualified, mname, DERIVED, sources, rebuilt_by, record, ref)
    return Inventory(items)


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The start of ``tensor``'s storage (None: no bytes, or no storage to share)."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # tensor subclasses without a storage
        return None
    return int(storage.data_ptr()) if storage.nbytes() else None


def _checkpoint_storages(model: nn.Module, holders: Mapping[int, str]) -> dict[int, str]:
    """Storage start -> the indexed module holding the checkpoint parameter that owns it."""
    storages: dict[int, str] = {}
    for param in model.parameters():
        key = _storage_key(param) if id(param) in holders else None
        if key is not None:
            storages[key] = holders[id(param)]
    return storages


def _weak(obj: Any) -> Callable[[], Any]:
    """A weak reference (so a replaced kernel's memory is freed), strong where unsupported."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _owned(module: nn.Module) -> dict[str, Any]:
    """Tensors and kernel objects ``module`` itself holds (not those of its submodules)."""
    out: dict[str, Any] = {}
    for name, param in module._parameters.items():
        if param is not None and param.device.type != "meta":
            out[name] = param
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.device.type != "meta":
            out[name] = buffer
    for name, value in vars(module).items():
        if name in ("_parameters", "_buffers", "_modules") or name in out:
            continue
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
            out |= {f"{name}.{i}": v for i, v in enumerate(value) if isinstance(v, torch.Tensor)}
        elif callable(value) and _kernel_state(name, value):
            out[name] = value
    for holder in ("quant_method", "impl"):
        obj = module.__dict__.get(holder)
        if obj is not None and not isinstance(obj, nn.Module):
            out |= {f"{holder}.{k}": v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}
    return out


def _kernel_state(name: str, fn: Any) -> bool:
    """Whether a callable attribute carries kernel state (tensors, or an opaque kernel handle)."""
    cells = getattr(fn, "__closure__", None) or ()
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.Tensor):
            return True
        if name in _KERNEL_CALLABLES and not isinstance(value, (*_PRIMITIVES, nn.Module)):
            return True
    return False


def _collect(model: nn.Module, only: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mname, module in model.named_modules():
        if only is not None and mname != only:
            continue
        out |= {f"{mname}.{k}" if mname else k: v for k, v in _owned(module).items()}
    return out
