"""Derived-state refreshers (engine-reload.md R4, gap 3 of the mission).

Some layers keep tensors computed from *other* modules' weights: MLA attention keeps
``W_UK_T``/``W_UV`` (CUDA) or VNNI-packed copies (CPU AMX) derived from ``kv_b_proj``. After any
write to a source module — full, partial or sparse — its refreshers run before the session
commits, and they write the new values **into the old storage** so captured addresses stay valid.

On CPU, a causal conv1d whose weight vLLM prepacked keeps an un-packed copy of it, and a mamba
mixer a view of the weight as it was before the prepack (:class:`CpuConvPrepackRefresher`).

Discovery is structural: every deferred attention layer that holds a reference to an indexed
module is a derived-state owner, and so is every indexed module vLLM's CPU dispatch prepacked.
Owners of a known type get a refresher; any other owner marks its sources as *unsupported*, and
updating such a source fails closed instead of leaving the derived copy stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from engine_agent.reload.inventory import _RUNTIME_ATTRS

__all__ = ["CpuConvPrepackRefresher", "DerivedRefresher", "MLARefresher", "find_refreshers"]


class DerivedRefresher(Protocol):
    """Rebuilds one layer's derived tensors from its (already processed) source modules."""

    #: Name of the layer that owns the derived tensors.
    name: str
    #: The layer itself (its parameters are swapped for the real ones while it refreshes).
    layer: nn.Module

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every derived tensor a kernel reads, by qualified name (for identity checks)."""
        ...

    def refresh(self, act_dtype: torch.dtype) -> list[str]:
        """Recompute the derived tensors in place; return the names of those it rebuilt."""
        ...


def _tensor_attrs(obj: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (``None`` for an inference tensor, which keeps none)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


class MLARefresher:
    """MLA attention: ``W_UK_T``/``W_UV`` (and backend-packed copies) from ``kv_b_proj``.

    Runs the layer's own ``process_weights_after_loading`` — the code that built the derived
    tensors at first load — then copies every tensor it replaced back into the storage the
    kernels captured, so the result is bit-identical to a cold load at the same address.

    It claims, and reports as refreshed, only what that step rebuilds: the layer's runtime state
    (KV cache, attention scales; :data:`~engine_agent.reload.inventory._RUNTIME_ATTRS`) is not
    derived from ``kv_b_proj``, and a tensor counts as rebuilt only if the step replaced it or
    wrote into it (its version counter moved). A claimed tensor it did neither to stays
    unlisted, and the inventory then refuses the commit (derived state not rebuilt).
    """

    def __init__(self, name: str, layer: nn.Module) -> None:
        self.name = name
        self.layer = layer

    def _holders(self) -> dict[str, Any]:
        holders: dict[str, Any] = {self.name: self.layer}
        impl = getattr(self.layer, "impl", None)
        if impl is not None:
            holders[f"{self.name}.impl"] = impl
        return holders

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {
            f"{self.name}.{k}": v for k, v in self.layer._parameters.items() if v is not None
        }
        for prefix, holder in self._holders().items():
            out |= {f"{prefix}.{k}": v for k, v in _tensor_attrs(holder).items()}
        return {k: v for k, v in out.items() if k.rsplit(".", 1)[-1] not in _RUNTIME_ATTRS}

    def refresh(self, act_dtype: torch.dtype) -> list[str]:
        from engine_agent.errors import IdentityChanged

        params_before = {k: v for k, v in self.layer._parameters.items() if v is not None}
        attrs_before = {p: _tensor_attrs(h) for p, h in self._holders().items()}
        claimed = self.tensors()
        versions = {qualified: _version(tensor) for qualified, tensor in claimed.items()}
        self.layer.process_weights_after_loading(act_dtype)  # type: ignore[operator]
        refreshed: list[str] = []

        def keep_storage(qualified: str, old: torch.Tensor, new: torch.Tensor | None) -> None:
            if new is None or new is old:
                before = versions.get(qualified)
                if new is old and before is not None and _version(old) != before:
                    refreshed.append(qualified)  # rebuilt in place by the layer itself
                return
            if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
                raise IdentityChanged(
                    f"{qualified}: refreshed tensor {new.dtype}{list(new.shape)} does not fit the "
                    f"captured storage {old.dtype}{list(old.shape)}",
                    field=qualified,
                )
            old.data.copy_(new.data)
            if qualified in claimed:
                refreshed.append(qualified)

        slots: dict[str, Any] = self.layer._parameters
        for key, old_param in params_before.items():
            keep_storage(f"{self.name}.{key}", old_param, slots.get(key))
            slots[key] = old_param
        for prefix, holder in self._holders().items():
            for key, old in attrs_before[prefix].items():
                keep_storage(f"{prefix}.{key}", old, vars(holder).get(key))
                setattr(holder, key, old)
        return refreshed


#: The attribute vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``) leaves on a causal
#: conv1d layer whose weight it prepacked: the weight's un-packed ``(dim, width)`` copy.
CPU_UNPACKED_CONV = "_cpu_unpacked_conv_weight"
#: Owner class name -> (child holding the conv weight, the owner's buffer built as a view of it).
#: vLLM's ``MambaMixer2`` registers ``conv_weights`` as a ``(dim, width)`` view of
#: ``conv1d.weight`` when it is built; once the CPU prepack replaces the weight's storage, that
#: view is the only holder of the old storage: a copy of the checkpoint weight, read by the
#: mixer's kernels, that nothing in vLLM rebuilds.
_CONV_WEIGHT_VIEWS = {"MambaMixer2": ("conv1d", "conv_weights")}


class CpuConvPrepackRefresher:
    """A causal conv1d prepacked for the CPU kernels: its un-packed copy, and the views of it.

    At a cold load vLLM's CPU GEMM dispatch (the conv1d's post-load step) replaces the weight's
    storage with ``causal_conv1d_weight_pack`` of it and keeps the un-packed ``(dim, width)``
    weight as :data:`CPU_UNPACKED_CONV` (Qwen3-Next's gated delta net reads it); a
    ``MambaMixer2`` further reads its ``conv_weights`` buffer, built as a view of the weight
    before the prepack and since then the sole holder of those bytes (FalconH1,
    GraniteMoeHybrid).

    The packed weight itself is the conv1d's parameter, rebuilt by its post-load step and copied
    into live storage like any processed parameter. This refresher runs after that step (on the
    staged checkpoint weight) and writes the un-packed copy it made into the storage the kernels
    captured — :data:`CPU_UNPACKED_CONV` and each view — so addresses are kept and the bytes are
    those vLLM's own step computed. Without a fresh post-load step (a sparse rebuild) it
    rebuilds nothing; such patches are refused earlier, as the live weight is not in checkpoint
    layout.
    """

    def __init__(self, name: str, layer: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
        self.name = name
        self.layer = layer
        #: The un-packed copy the kernels captured at begin (restored after every refresh).
        self._unpacked: torch.Tensor = vars(layer)[CPU_UNPACKED_CONV]
        self._views = dict(views)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f"{self.name}.{CPU_UNPACKED_CONV}": self._unpacked} | self._views

    def refresh(self, act_dtype: torch.dtype) -> list[str]:
        from engine_agent.errors import IdentityChanged

        new = vars(self.layer).get(CPU_UNPACKED_CONV)
        if new is None or new is self._unpacked:
            return []  # no post-load step ran since the last refresh: nothing to copy
        setattr(self.layer, CPU_UNPACKED_CONV, self._unpacked)
        refreshed: list[str] = []
        for qualified, old in self.tensors().items():
            if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
                raise IdentityChanged(
                    f"{qualified}: the refreshed conv weight {new.dtype}{list(new.shape)} does "
                    f"not fit the captured storage {old.dtype}{list(old.shape)}",
                    field=qualified,
                )
            old.copy_(new)
            refreshed.append(qualified)
        return refreshed


#: Owner layer class name -> refresher factory. Owners not listed fail closed.
_REFRESHERS = {"MLAAttention": MLARefresher}


def _conv_prepack_refreshers(
    model: nn.Module, indexed: Mapping[int, str]
) -> dict[str, CpuConvPrepackRefresher]:
    """A refresher for every indexed conv1d vLLM's CPU dispatch prepacked, by its name."""
    prepacked = {
        id(m): (n, m)
        for n, m in model.named_modules()
        if id(m) in indexed and isinstance(vars(m).get(CPU_UNPACKED_CONV), torch.Tensor)
    }
    if not prepacked:
        return {}
    views: dict[int, dict[str, torch.Tensor]] = {}
    for name, owner in model.named_modules():
        spec = next(
            (v for cls in type(owner).__mro__ if (v := _CONV_WEIGHT_VIEWS.get(cls.__name__))),
            None,
        )
        if spec is None:
            continue
        child, buffer = getattr(owner, spec[0], None), owner._buffers.get(spec[1])
        if child is None or id(child) not in prepacked or buffer is None:
            continue
        views.setdefault(id(child), {})[f"{name}.{spec[1]}" if name else spec[1]] = buffer
    return {
        name: CpuConvPrepackRefresher(name, module, views.get(key, {}))
        for key, (name, module) in prepacked.items()
    }


def find_refreshers(
    model: nn.Module, indexed: Mapping[int, str]
) -> tuple[dict[str, list[DerivedRefresher]], dict[str, str]]:
    """Find derived-state owners and map each source module to its refreshers.

    Args:
        model: the rank's model.
        indexed: ``id(module) -> name`` of every module with checkpoint parameters.

    Returns:
        ``(refreshers by source module name, unsupported source name -> reason)``.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    refreshers: dict[str, list[DerivedRefresher]] = {
        name: [refresher] for name, refresher in _conv_prepack_refreshers(model, indexed).items()
    }
    unsupported: dict[str, str] = {}
    for name, layer in model.named_modules():
        if not is_deferred_attention_layer(layer):
            continue
        holders = [layer, getattr(layer, "impl", None)]
        sources = {
            indexed[id(value)]
            for holder in holders
            if holder is not None
            for value in vars(holder).values()
            if isinstance(value, nn.Module) and id(value) in indexed
        }
        sources |= {indexed[id(child)] for child in layer.children() if id(child) in indexed}
        if not sources:
            continue
        factory = next(
            (f for cls in type(layer).__mro__ if (f := _REFRESHERS.get(cls.__name__))), None
        )
        for source in sorted(sources):
            if factory is None:
                unsupported[source] = (
                    f"{type(layer).__name__} layer {name} derives state from it and weightroll "
                    "has no refresher for that layer type"
                )
            else:
                refreshers.setdefault(source, []).append(factory(name, layer))
    return refreshers, unsupported
