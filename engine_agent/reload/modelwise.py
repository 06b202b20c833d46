"""Modulewise reload inside one vLLM rank: load routing and per-module processing.

With :mod:`.index` (which modules the checkpoint fills, and their shard sets),
:mod:`.processing` (what happens to a complete module) and :mod:`.sparse_plan` (where a sparse
patch lands), this is the part of the reload that knows vLLM's internals. It keeps the model's
own ``load_weights`` in charge of name mapping, TP sharding, fused QKV / gate-up and expert
routing, and changes only *where the bytes go* and *when a module counts as complete*:

1. **Index** (:func:`engine_agent.reload.index.build_index`): every module with
   checkpoint-format parameters, their meta templates and the rank's required shard set.
2. **Routing** (:class:`LoadRouter`). For the duration of one ``model.load_weights`` call every
   indexed parameter is replaced by its meta template whose ``weight_loader`` is wrapped. The
   wrapper computes the shard keys of the call from the bound loader arguments, refuses
   duplicates and out-of-scope keys *before* writing, and writes into a per-module **staging**
   tensor in checkpoint layout (never into live storage). A dry run over meta tensors validates
   a whole batch (unknown names, shapes, duplicates) before any byte is written. A loader that
   writes a parameter itself is routed the same way (:mod:`.direct`).
3. **Processing** (:class:`engine_agent.reload.processing.ModuleProcessor`, handed each
   module by the router). When a module's staging covers its required set (set coverage,
   never element counts), its post-load processing runs on the staging tensors
   — quant method, the experts' kernel-format prepack, then every derived-state refresher
   sourced from this module (MLA ``W_UK_T``/``W_UV``) — and the results are ``copy_``-ed into
   the live tensors, so no kernel-visible address moves; then every other module holding one
   of its parameter objects (tied embeddings) re-runs its own post-load step. The rank is
   marked dirty before the first of these steps: a post-load step already swaps the live
   module's kernel (on CPU a new ``cpu_linear`` closure).
4. **Sparse patches** (:meth:`LoadRouter.apply_sparse`): planned by :mod:`.sparse_plan`
   before any write, written in place here, then the patched modules' kernel state rebuilt.

Limitations:
    1. Models with a model-level ``process_weights_after_loading`` hook are refused at begin.
    2. Deferred attention layers that read other modules' weights are supported only where a
       refresher is registered (:mod:`engine_agent.reload.derived`); others fail closed.
    3. A parameter held by several modules is indexed once, under its first holder
       (:mod:`.index`). A sharer with no checkpoint parameter of its own (the tied LM head)
       re-runs its post-load step after the owner's bytes changed (its kernel may keep its own
       packed copy); an indexed sharer is processed after the owner, from its own staging, and
       must therefore be reloaded with it (else refused at begin, and sparse patches of the
       shared parameter are refused).
    4. Sparse patches are accepted only for parameters whose live layout is the checkpoint
       layout, mapped through the parameter's own weight loader (see :mod:`.sparse_plan`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine_agent.errors import (
    LoaderUnsupported,
    ShapeMismatch,
    UnknownTensor,
)
from engine_agent.reload.adopt import Adoptions
from engine_agent.reload.coverage import WHOLE, CoverageLedger, ShardKey
from engine_agent.reload.direct import DirectWrites
from engine_agent.reload.index import ModelIndex, ModuleEntry, live_tensor
from engine_agent.reload.inventory import Inventory
from engine_agent.reload.processing import ModuleProcessor, parameter_slots
from engine_agent.reload.sparse_plan import plan_sparse

__all__ = ["LoadRouter", "tensor_digest"]

logger = logging.getLogger(__name__)


def tensor_digest(tensor: torch.Tensor) -> str:
    """Digest of a tensor's bytes where they live (BLAKE3 on host, a fingerprint on a device)."""
    from engine_agent.reload.digest import tensor_digest as where_they_live

    return where_they_live(tensor)


def _same_kind(a: torch.dtype, b: torch.dtype) -> bool:
    return a.is_floating_point == b.is_floating_point and (a == torch.bool) == (b == torch.bool)


class LoadRouter:
    """Routes ``model.load_weights`` into staging tensors; its processor processes complete modules.

    Args:
        index: the rank's model index.
        ledger: coverage ledger of the session (keys are recorded as they are written).
        device: where staging tensors are allocated (the device of the live weights).
        act_dtype: the model's activation dtype (attention post-load processing needs it).
        before_live_write: called once, right before the first kernel-visible change (a
            module's post-load step, a refresher, a kernel swap or a live byte).
        inventory: the session's inventory (which kernel objects a post-load step rebuilt).
        failpoint: called at every step boundary with its name (tests; see
            :mod:`engine_agent.reload.failpoints`).
        processor: what processes complete modules (a prefetch's router processes them on
            shadows, :class:`engine_agent.reload.shadow.ShadowProcessor`).
    """

    def __init__(
        self,
        index: ModelIndex,
        ledger: CoverageLedger,
        device: torch.device,
        act_dtype: torch.dtype,
        before_live_write: Callable[[], None],
        inventory: Inventory | None = None,
        failpoint: Callable[[str], None] = lambda _point: None,
        processor: type[ModuleProcessor] = ModuleProcessor,
    ) -> None:
        self.index = index
        self.ledger = ledger
        self.device = device
        self._failpoint = failpoint
        #: id(module) -> its real parameters while proxies are installed.
        self._originals: dict[int, dict[str, Any]] = {}
        #: id(module) -> its real buffers while proxies of its checkpoint buffers are installed.
        self._buffer_originals: dict[int, dict[str, Any]] = {}
        #: sparse coordinate pass: (module, parameter) -> checkpoint positions, else None.
        self._coords: dict[tuple[str, str], torch.Tensor] | None = None
        self._staging: dict[str, dict[str, torch.Tensor]] = {}
        self.bytes_loaded = 0
        self._dry_keys: list[ShardKey] | None = None
        #: Watches loaders that write parameters themselves, while the proxies are installed.
        self._direct: DirectWrites | None = None
        #: Processes complete modules (:mod:`.processing`; during a prefetch on shadows,
        #: :mod:`.shadow`); refuses stale sharers here, at begin.
        self.processing = processor(
            index,
            ledger,
            inventory if inventory is not None else index.inventory(),
            act_dtype,
            before_live_write,
            failpoint,
            self._staging,
            self._originals,
            self._buffer_originals,
        )
        #: The prefetch's read buffers its staging adopted instead of copying (:mod:`.adopt`).
        self._adoptions = (
            Adoptions(lambda name: name in self.processing.processed)
            if self.processing.adopts_reads
            else None
        )

    # What the session reports, kept by the processor.

    @property
    def inventory(self) -> Inventory:
        return self.processing.inventory

    @property
    def processed(self) -> set[str]:
        return self.processing.processed

    @property
    def rebuilt(self) -> set[str]:
        """Derived items (inventory names) rebuilt in this session."""
        return self.processing.rebuilt

    @property
    def derived_refreshed(self) -> list[str]:
        return self.processing.derived_refreshed

    @property
    def module_digests(self) -> dict[str, str]:
        return self.processing.module_digests

    @property
    def timings(self) -> dict[str, float]:
        """Seconds per processing step, summed over modules (digest, post_load, copy_live, ...)."""
        return self.processing.timings

    # -- the two passes -----------------------------------------------------------------

    def dry_run(
        self, names_shapes: Iterable[tuple[str, torch.Size, torch.dtype]]
    ) -> list[ShardKey]:
        """Run ``load_weights`` over meta tensors: validate names, shapes and keys, write nothing.

        Returns:
            The shard keys the real load will write, already checked against the ledger.
        """
        batch = [(n, torch.empty(s, dtype=d, device="meta")) for n, s, d in names_shapes]
        self._dry_keys = []
        try:
            with self._installed(dry=True):
                self._call_load_weights(batch)
            keys = self._dry_keys
        finally:
            self._dry_keys = None
        self.ledger.check(keys)
        return keys

    @property
    def bytes_adopted(self) -> int:
        """Bytes whose staging adopted the read buffer instead of copying it (:mod:`.adopt`)."""
        return 0 if self._adoptions is None else self._adoptions.bytes_adopted

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write ``weights`` into staging; modules that become complete are processed."""
        with self._installed(dry=False):
            self._call_load_weights(weights)

    def _call_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The tensor the loaders were handed last: a loader's own error (often a bare
        # ``assert``) names neither the tensor nor its shape, so the refusal does (issue 26, 9).
        current: list[tuple[str, torch.Tensor]] = []

        def handed_out() -> Iterator[tuple[str, torch.Tensor]]:
            for pair in weights:
                current[:] = [pair]
                yield pair

        try:
            assert self._direct is not None, "load_weights runs with the proxies installed"
            with self._direct:
                self.index.model.load_weights(handed_out())  # type: ignore[operator]
        except KeyError as e:
            raise UnknownTensor(
                f"checkpoint tensor {e.args[0]!r} maps to no parameter of this model",
                field=str(e.args[0]),
            ) from e
        except (AssertionError, RuntimeError, ValueError) as e:
            if isinstance(e, UnknownTensor | ShapeMismatch | LoaderUnsupported):
                raise
            if "no module or parameter named" in str(e):  # vLLM's AutoWeightsLoader
                raise UnknownTensor(
                    f"a checkpoint tensor maps to no parameter of this model: {e}"
                ) from e
            if not current:
                raise ShapeMismatch(f"the model's weight loader rejected a tensor: {e}") from e
            name, tensor = current[0]
            if "Cannot copy out of meta tensor" in str(e):
                # The copy's source was never materialised: in the check run every tensor is
                # a meta tensor and only indexed slots hold proxies, so the loader copied this
                # tensor into a live tensor the update does not account for.
                raise LoaderUnsupported(
                    f"{name}: the model's loader copies it into a live tensor this update does "
                    "not account for (in the check run the tensor is never materialised: "
                    f"{e}); the live tensor is not indexed as a checkpoint tensor",
                    field=name,
                ) from e
            raise ShapeMismatch(
                f"{name}: the model's weight loader rejected it ({tensor.dtype} "
                f"{list(tensor.shape)}): {str(e) or type(e).__name__}",
                field=name,
            ) from e

    # -- installation of templates ------------------------------------------------------

    @contextmanager
    def _installed(self, *, dry: bool) -> Iterator[None]:
        """Swap every parameter of the model for a proxy for one ``load_weights`` call.

        Indexed parameters get a routing proxy; every other parameter (derived tensors such as
        MLA's ``W_UV``) gets a guard whose loader refuses, so no checkpoint name can reach a
        live tensor by a path that bypasses the accounting.
        """
        saved: list[tuple[nn.Module, dict[str, Any]]] = []
        saved_buffers: list[tuple[nn.Module, dict[str, Any]]] = []
        entries = {id(e.module): e for e in self.index.entries.values()}
        self._direct = DirectWrites(self._route_direct, self._refuse_direct)
        try:
            for owner in entries.values():
                # Checkpoint buffers (index._checkpoint_buffers) are handed to their loader as
                # ``AutoWeightsLoader`` finds them, in the module's buffer slots: routed alike.
                routed = [b for b in owner.module._buffers if b in owner.templates]
                if not routed:
                    continue
                saved_buffers.append((owner.module, dict(owner.module._buffers)))
                self._buffer_originals[id(owner.module)] = saved_buffers[-1][1]
                for bname in routed:
                    template = owner.templates[bname]
                    proxy = self._wrapped(owner, bname, template, dry)
                    self._direct.register(proxy, _Direct(owner, bname, template, dry))
                    owner.module._buffers[bname] = proxy
            for name, module in self.index.model.named_modules():
                if not module._parameters:
                    continue
                saved.append((module, dict(module._parameters)))
                self._originals[id(module)] = saved[-1][1]
                entry = entries.get(id(module))
                templates = entry.templates if entry is not None else {}
                for pname, live in list(module._parameters.items()):
                    if pname in templates and entry is not None:
                        template = templates[pname]
                        proxy = self._wrapped(entry, pname, template, dry)
                        self._direct.register(proxy, _Direct(entry, pname, template, dry))
                    elif live is not None:
                        qualified = f"{name}.{pname}" if name else pname
                        proxy = _guard(qualified, live)
                        self._direct.register(proxy, qualified)
                    else:
                        continue
                    parameter_slots(module)[pname] = proxy
            yield
        finally:
            for module, params in saved:
                module._parameters.clear()
                module._parameters.update(params)
            for module, real in saved_buffers:
                module._buffers.clear()
                module._buffers.update(real)
            self._originals.clear()
            self._buffer_originals.clear()
            self._direct = None

    def _wrapped(
        self, entry: ModuleEntry, pname: str, template: torch.Tensor, dry: bool
    ) -> torch.Tensor:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        original = getattr(template, "weight_loader", None) or default_weight_loader
        signature = inspect.signature(original)
        proxy = _meta_like(template)
        in_scope = self.ledger.in_scope(entry.name)

        def weightroll_loader(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            loaded = bound.arguments.get("loaded_weight")
            if self._coords is not None:  # sparse coordinate pass: where each element lands
                like = loaded.dtype if isinstance(loaded, torch.Tensor) else torch.int64
                positions = torch.zeros(template.shape, dtype=like, device="cpu")
                positions.__class__ = template.__class__
                positions.__dict__ = template.__dict__.copy()
                bound.arguments["param"] = positions
                result = self._accounted(original, bound)
                if result is not False:
                    self._coords[(entry.name, pname)] = positions
                return result
            if isinstance(loaded, torch.Tensor) and not _same_kind(loaded.dtype, template.dtype):
                raise ShapeMismatch(
                    f"{entry.name}.{pname}: checkpoint dtype {loaded.dtype} cannot be loaded into "
                    f"a {template.dtype} parameter",
                    field=f"{entry.name}.{pname}",
                )
            keys = entry.keys_for_call(pname, bound)
            if keys and not in_scope:
                raise UnknownTensor(
                    f"{entry.name}.{pname} is outside this update's scope",
                    field=f"{entry.name}.{pname}",
                )
            if dry:
                assert self._dry_keys is not None
                self._dry_keys.extend(keys)
                bound.arguments["param"] = proxy
                return self._accounted(original, bound)
            self.ledger.check(keys)
            staging = self._staging_tensor(entry, pname, template)
            bound.arguments["param"] = staging
            if self._adoptions is None:
                result = self._accounted(original, bound)
            else:
                self._adoptions.reading(loaded)
                with self._adoptions.during(entry.name, pname, staging):
                    result = self._accounted(original, bound)
            if result is False:  # an expert this rank does not own: nothing was written
                return result
            self._staged(entry, keys, loaded)
            return result

        proxy.weight_loader = weightroll_loader  # type: ignore[attr-defined]
        return proxy

    def _accounted(self, loader: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        """Run a parameter's own loader: its writes are accounted here, not direct ones."""
        assert self._direct is not None
        with self._direct.accounted():
            return loader(*bound.args, **bound.kwargs)

    def _staged(self, entry: ModuleEntry, keys: list[ShardKey], loaded: Any) -> None:
        """``keys`` of ``entry`` were written into staging: record them; process the module
        once it is complete."""
        if isinstance(loaded, torch.Tensor):
            self.bytes_loaded += loaded.numel() * loaded.element_size()
        for key in keys:
            self.ledger.record(key)
        if keys and self.ledger.is_complete(entry.name):
            self._failpoint("load.staged")
            self.processing.complete(entry)

    def _route_direct(self, target: Any, tensor: Any) -> None:
        """A loader wrote ``tensor`` whole into a parameter itself (:mod:`.direct`): account it
        as that parameter's loader receiving it whole, every shard of it at once."""
        if isinstance(target, str):  # a guarded tensor: no checkpoint may write it
            self._refuse_direct(target, "the model's loader writes it")
        assert isinstance(target, _Direct)
        entry, pname, template = target.entry, target.param, target.template
        where = f"{entry.name}.{pname}"
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(template.shape):
            got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ShapeMismatch(
                f"{where}: the model's loader writes {got} into it directly; the parameter's "
                f"shape is {list(template.shape)}",
                field=where,
            )
        if self._coords is not None:  # sparse coordinate pass: where each element lands
            self._coords[(entry.name, pname)] = tensor.detach().to("cpu", copy=True)
            return
        if not _same_kind(tensor.dtype, template.dtype):
            raise ShapeMismatch(
                f"{where}: checkpoint dtype {tensor.dtype} cannot be loaded into a "
                f"{template.dtype} parameter",
                field=where,
            )
        if not self.ledger.in_scope(entry.name):
            raise UnknownTensor(f"{where} is outside this update's scope", field=where)
        keys = sorted(k for k in entry.required if k.param == pname) or [
            ShardKey(entry.name, pname, WHOLE)
        ]
        if target.dry:
            assert self._dry_keys is not None
            self._dry_keys.extend(keys)
            return
        self.ledger.check(keys)
        if self._adoptions is not None:
            self._adoptions.reading(tensor)
        self._staging_tensor(entry, pname, template).copy_(tensor)
        self._staged(entry, keys, tensor)

    @staticmethod
    def _refuse_direct(target: Any, what: str) -> None:
        if isinstance(target, str):
            raise UnknownTensor(
                f"{target} is not a checkpoint parameter of this model (derived or runtime "
                f"state), but {what}; remove it from the checkpoint",
                field=target,
            )
        where = f"{target.entry.name}.{target.param}"
        raise LoaderUnsupported(
            f"{where}: {what}; such a write cannot be accounted shard by shard, so this "
            "model's update is refused (report the architecture)",
            field=where,
        )

    def _staging_tensor(
        self, entry: ModuleEntry, pname: str, template: torch.Tensor
    ) -> torch.Tensor:
        staged = self._staging.setdefault(entry.name, {})
        tensor = staged.get(pname)
        if tensor is None:
            # Allocated as vLLM allocates the parameters of a cold engine (``torch.empty`` in
            # ``create_weights``): a module is processed only when every required shard arrived,
            # and the regions the loaders themselves pad they also fill (vocab padding rows are
            # zeroed by the embedding's loader), so what the kernels read is what a cold engine
            # loads. Zero-filling first cost a third of the load on a 2-core CPU (bench/reload.py).
            tensor = torch.empty(template.shape, dtype=template.dtype, device=self.device)
            tensor.__class__ = template.__class__
            tensor.__dict__ = template.__dict__.copy()
            staged[pname] = tensor
        return tensor

    # -- sparse patches ----------------------------------------------------------------

    def apply_sparse(
        self, patches: list[tuple[str, torch.Size, torch.Tensor, torch.Tensor]]
    ) -> list[ShardKey]:
        """Apply flat-index patches ``(name, checkpoint shape, indices, values)`` in place.

        Every patch is planned first (:func:`~engine_agent.reload.sparse_plan.plan_sparse`:
        mapping through the parameter's own weight loader, layout, bounds, dtype, derived
        state), before the first write; elements other ranks hold are skipped here. Then the
        patched modules' kernel state is rebuilt from their live weights.

        Returns:
            The shard key of every patched parameter (recorded in the ledger).

        Raises:
            SparseRefused: a patched module's live layout is not its checkpoint layout, its
                elements cannot be mapped one-to-one, or derived state of it has no refresher.
        """
        plan = plan_sparse(self, patches)
        all_keys = [write.key for write in plan]
        self.ledger.check(all_keys)
        self._failpoint("sparse.before_write")
        for write in plan:
            self.processing.mark_dirty()
            live = live_tensor(write.entry.module, write.param)
            assert live is not None
            local, values = write.local.to(live.device), write.values.to(live.device)
            live.data.view(-1).index_copy_(0, local, values)
            self.ledger.record(write.key)
            self.bytes_loaded += write.values.numel() * write.values.element_size()
            self._failpoint("sparse.after_write")
        for entry in {write.entry.name: write.entry for write in plan}.values():
            self.processing.rebuild_in_place(entry)
        return all_keys

    def land(
        self, name: str, entry: ModuleEntry, pname: str, tensor: torch.Tensor
    ) -> torch.Tensor | None:
        """What the model's ``load_weights`` writes into a CPU stand-in of ``entry.pname`` when
        fed ``tensor`` as checkpoint tensor ``name`` (None: it wrote nothing there).

        The coordinate pass of sparse planning (:mod:`.sparse_plan`): nothing is staged,
        recorded or written to live storage.
        """
        self._coords = {}
        try:
            with self._installed(dry=False):
                self._call_load_weights([(name, tensor)])
            return self._coords.get((entry.name, pname))
        finally:
            self._coords = None

    def discard(self) -> None:
        """Drop every staging tensor (abort or failure): live storage is left as it is."""
        self._staging.clear()
        if self._adoptions is not None:
            self._adoptions.clear()
        self.processing.discard()


@dataclass(frozen=True, slots=True)
class _Direct:
    """A proxy's parameter, as :class:`~engine_agent.reload.direct.DirectWrites` reports it."""

    entry: ModuleEntry
    param: str
    template: torch.Tensor
    dry: bool


def _guard(qualified: str, live: torch.Tensor) -> torch.Tensor:
    """A meta stand-in for a parameter no checkpoint may write."""
    proxy = _meta_like(live)

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise UnknownTensor(
            f"{qualified} is not a checkpoint parameter of this model (derived or runtime state); "
            "remove it from the checkpoint",
            field=qualified,
        )

    proxy.weight_loader = refuse  # type: ignore[attr-defined]
    return proxy


def _meta_like(template: torch.Tensor) -> torch.Tensor:
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

    return to_meta_tensor(template)
