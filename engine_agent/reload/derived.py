"""Derived-state refreshers (engine-reload.md R4, gap 3 of the mission).

Some layers keep tensors computed from *other* modules' weights: MLA attention keeps
``W_UK_T``/``W_UV`` (CUDA) or VNNI-packed copies (CPU AMX) derived from ``kv_b_proj``. After any
write to a source module — full, partial or sparse — its refreshers run before the session
commits, and they write the new values **into the old storage** so captured addresses stay valid.

Discovery is structural: every deferred attention layer that holds a reference to an indexed
module is a derived-state owner. Owners of a known type get a refresher; any other owner marks
its sources as *unsupported*, and updating such a source fails closed instead of leaving the
derived copy stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from engine_agent.reload.inventory import _RUNTIME_ATTRS

__all__ = ["DerivedRefresher", "MLARefresher", "find_refreshers"]


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


#: Owner layer class name -> refresher factory. Owners not listed fail closed.
_REFRESHERS = {"MLAAttention": MLARefresher}


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

    refreshers: dict[str, list[DerivedRefresher]] = {}
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
