"""Planning a sparse patch: where each checkpoint element lands on this rank, or why it cannot.

A sparse patch (:mod:`.sparse`, the file format) lists flat indices in *checkpoint*
coordinates. Before the router (:meth:`.modelwise.LoadRouter.apply_sparse`) writes a single
byte, :func:`plan_sparse` turns every patch into a :class:`PatchWrite` — the parameter, its
shard key and the flat *local* positions this rank holds with their values — or refuses the
whole patch set. Planning writes nothing; the router owns the writes, the dirty mark, the
ledger and the in-place rebuild.

What it needs from the router is small (:class:`Router`): the index and inventory, the dry run
(which module and shard a checkpoint name maps to) and the coordinate pass (what the model's
own ``load_weights`` writes into a CPU stand-in of one parameter).

Limitations:
    1. Only parameters whose live layout is the checkpoint layout are patched (norms,
       embeddings, and linears whose kernel reads the live weight); everything else is refused
       with the module named, and so is a parameter another indexed module also holds.
    2. Mapping needs one temporary int64 tensor of the checkpoint tensor's size, and a probe of
       its dtype. A loader that computes what it stores (``x + offset``) makes the patch
       refused, not transformed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine_agent.errors import InvalidRequest, ShapeMismatch, SparseRefused
from engine_agent.reload.coverage import WHOLE, ShardKey
from engine_agent.reload.index import ModelIndex, ModuleEntry, live_tensor
from engine_agent.reload.inventory import Inventory

__all__ = ["PatchWrite", "Router", "plan_sparse"]

#: One patch as :func:`engine_agent.reload.sparse.read_patches` returns it:
#: ``(checkpoint name, checkpoint shape, flat indices, values)``.
Patch = tuple[str, torch.Size, torch.Tensor, torch.Tensor]


class Router(Protocol):
    """What planning reads from :class:`engine_agent.reload.modelwise.LoadRouter`."""

    @property
    def index(self) -> ModelIndex: ...

    @property
    def inventory(self) -> Inventory: ...

    def dry_run(
        self, names_shapes: Iterable[tuple[str, torch.Size, torch.dtype]]
    ) -> list[ShardKey]: ...

    def land(
        self, name: str, entry: ModuleEntry, pname: str, tensor: torch.Tensor
    ) -> torch.Tensor | None: ...


@dataclass(frozen=True, slots=True)
class PatchWrite:
    """One planned write: ``values`` go to flat positions ``local`` of ``entry.param``."""

    entry: ModuleEntry
    param: str
    key: ShardKey
    #: flat positions in this rank's live parameter (int64), one per value.
    local: torch.Tensor
    values: torch.Tensor


def plan_sparse(router: Router, patches: list[Patch]) -> list[PatchWrite]:
    """Validate every patch and map it onto this rank's live parameters; write nothing.

    Indices are positions in the *checkpoint* tensor. Each is mapped through the parameter's
    own weight loader (:func:`_local_positions`) to the local position where this rank holds
    that element; elements other ranks hold are left out of the plan.

    Returns:
        One write per patch, in the patches' order.

    Raises:
        SparseRefused: a patched module's live layout is not its checkpoint layout, its
            elements cannot be mapped one-to-one, or derived state of it has no refresher.
        ShapeMismatch: values of another dtype than the parameter, indices and values not 1-D
            of equal length, or an index out of range.
        InvalidRequest: an index repeats.
    """
    plan: list[PatchWrite] = []
    for name, shape, indices, values in patches:
        keys = router.dry_run([(name, shape, values.dtype)])
        if len(keys) != 1 or keys[0].shard != WHOLE:
            raise SparseRefused(
                f"{name} maps to {', '.join(map(str, keys)) or 'nothing'}: sparse patches are "
                "only accepted for tensors that map one-to-one onto a live parameter",
                field=name,
            )
        key = keys[0]
        entry = router.index.entries[key.module]
        reason = _layout_refusal(entry, key.param) or _sharer_refusal(router.index, entry)
        stale = router.inventory.unsupported({entry.name})
        if reason is None and stale:
            reason = f"{stale[0].name} is derived from it and nothing rebuilds it"
        if reason is not None:
            raise SparseRefused(
                f"cannot patch {name} in place: module {entry.name} is refused because "
                f"{reason}; send a full or partial update for it instead",
                field=name,
            )
        live = live_tensor(entry.module, key.param)
        assert live is not None
        if values.dtype != live.dtype:
            raise ShapeMismatch(
                f"{name}: patch values are {values.dtype}, the live parameter is {live.dtype}",
                field=name,
            )
        if indices.dim() != 1 or values.shape != indices.shape:
            raise ShapeMismatch(
                f"{name}: indices and values must be 1-D and of equal length "
                f"(got {list(indices.shape)} and {list(values.shape)})",
                field=name,
            )
        numel = math.prod(shape)
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
            raise ShapeMismatch(f"{name}: patch index out of range [0, {numel})", field=name)
        if indices.numel() != torch.unique(indices).numel():
            # index_copy_ with a repeated index leaves either value: ranks holding the same
            # replicated element could disagree, and no later check would see it.
            raise InvalidRequest(
                f"{name}: a patch index repeats; each element may be patched once",
                field=name,
            )
        local = _local_positions(router, name, shape, entry, key.param, live, indices, values)
        local = local[indices]
        mine = local >= 0
        plan.append(PatchWrite(entry, key.param, key, local[mine], values[mine]))
    return plan


def _layout_refusal(entry: ModuleEntry, param: str) -> str | None:
    """Why a sparse patch of ``entry.param`` cannot be applied in place (None: it can)."""
    live = live_tensor(entry.module, param)
    template = entry.templates.get(param)
    if live is None or template is None:
        return "it has no such checkpoint parameter"
    if tuple(live.shape) != tuple(template.shape):
        return (
            f"its live layout {list(live.shape)} is not the checkpoint layout "
            f"{list(template.shape)} (packed for its kernel)"
        )
    quant_method = getattr(entry.module, "quant_method", None)
    method = type(quant_method).__name__ if quant_method is not None else None
    cpu_linear = entry.module.__dict__.get("cpu_linear")
    if method in (None, "UnquantizedEmbeddingMethod"):
        return None
    if method == "UnquantizedLinearMethod" and (
        cpu_linear is None or cpu_linear is torch.nn.functional.linear
    ):
        return None
    return f"its kernel ({method}) keeps its own copy of the weights"


def _sharer_refusal(index: ModelIndex, entry: ModuleEntry) -> str | None:
    """Why a patch of ``entry`` would leave a module sharing its parameter stale (None: it
    would not). Such a module (experts holding their block's routing bias) has kernel-format
    weights its post-load step cannot be re-run on (``LoadRouter._refuse_stale_sharers``)."""
    for holder_name, _holder, pname in index.sharers.get(entry.name, []):
        if holder_name in index.entries:
            return (
                f"its parameter {pname} is also held by {holder_name}, whose kernel-format "
                "weights cannot be processed again in place"
            )
    return None


def _local_positions(
    router: Router,
    name: str,
    shape: torch.Size,
    entry: ModuleEntry,
    pname: str,
    live: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor,
) -> torch.Tensor:
    """For every flat checkpoint index of ``name``: where this rank holds it, or -1.

    Loads a tensor of checkpoint positions (``arange + 1``) through the model's own
    ``load_weights`` into an int64 stand-in of the parameter, so name mapping, TP slicing
    and padding are exactly the loader's. A position two local elements claim cannot be
    patched one-to-one and is refused.

    The mapping is only a mapping if the loader moves values without changing them; some
    loaders compute (Plamo3 norms ``x + offset``, LongCat-Flash ``x * scale``, Mamba2
    ``A = -exp(x)``), and a cold engine holds what they compute, not the checkpoint value.
    So positions must land as positions, and a probe of the parameter's dtype — the patch's
    own values at its indices, values of every magnitude elsewhere — loaded the same way,
    must land bit for bit where the positions say. Otherwise the patch is refused, naming
    the loader, before anything is written (issue 26, item 1).

    Raises:
        SparseRefused: the mapping is not one-to-one, the loader wrote no positions, or the
            loader transforms the values it loads.
    """
    numel = math.prod(shape)
    positions = torch.arange(1, numel + 1, dtype=torch.int64).reshape(shape)
    landed = router.land(name, entry, pname, positions)
    if landed is None or landed.numel() != live.numel():
        raise SparseRefused(
            f"cannot patch {name} in place: its weight loader did not map it onto "
            f"{entry.name}.{pname}",
            field=name,
        )
    flat = landed.reshape(-1) - 1
    # -1: an element no checkpoint position reaches (padding the loader leaves); anything
    # else outside [0, numel) was computed, not moved.
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= numel):
        raise _transforming(name, entry, pname)
    held = flat >= 0
    source = flat[held]
    generator = torch.Generator().manual_seed(numel)
    scale = torch.exp2(torch.randint(-24, 24, (numel,), generator=generator).float())
    probe = (torch.randn(numel, generator=generator) * scale).to(live.dtype)
    probe[indices] = values.to(live.dtype)
    probed = router.land(name, entry, pname, probe.reshape(shape))
    if probed is None or not torch.equal(_raw(probed.reshape(-1)[held]), _raw(probe[source])):
        raise _transforming(name, entry, pname)
    if torch.unique(source).numel() != source.numel():
        raise SparseRefused(
            f"cannot patch {name} in place: this rank holds some of its elements more than "
            "once (replicated within the parameter); send a full or partial update instead",
            field=name,
        )
    lookup = torch.full((numel,), -1, dtype=torch.int64)
    lookup[source] = torch.nonzero(held).reshape(-1)
    return lookup


def _transforming(name: str, entry: ModuleEntry, pname: str) -> SparseRefused:
    loader = getattr(entry.templates[pname], "weight_loader", None)
    qualname = getattr(loader, "__qualname__", None) or type(loader).__name__
    label = f"{getattr(loader, '__module__', None) or '?'}.{qualname}"
    return SparseRefused(
        f"cannot patch {name} in place: the weight loader of {entry.name}.{pname} "
        f"({label}) transforms the values it loads, so a checkpoint value is not what a "
        "cold engine holds; send a full or partial update for it instead",
        field=name,
    )


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (bit-for-bit comparison: NaN equals NaN, -0.0 is not 0.0)."""
    return tensor.contiguous().view(torch.uint8)
