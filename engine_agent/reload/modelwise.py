"""Modulewise reload inside one vLLM rank: load routing and per-module processing.

With :mod:`.index` (which modules the checkpoint fills, and their shard sets) and
:mod:`.sparse_plan` (where a sparse patch lands), this is the part of the reload that knows
vLLM's internals. It keeps the model's own ``load_weights`` in charge of name mapping, TP
sharding, fused QKV / gate-up and expert routing, and changes only *where the bytes go* and
*when a module counts as complete*:

1. **Index** (:func:`engine_agent.reload.index.build_index`): every module with
   checkpoint-format parameters, their meta templates and the rank's required shard set.
2. **Routing** (:class:`LoadRouter`). For the duration of one ``model.load_weights`` call every
   indexed parameter is replaced by its meta template whose ``weight_loader`` is wrapped. The
   wrapper computes the shard keys of the call from the bound loader arguments, refuses
   duplicates and out-of-scope keys *before* writing, and writes into a per-module **staging**
   tensor in checkpoint layout (never into live storage). A dry run over meta tensors validates
   a whole batch (unknown names, shapes, duplicates) before any byte is written. A loader that
   writes a parameter itself is routed the same way (:mod:`.direct`).
3. **Processing** (:meth:`LoadRouter.process`). When a module's staging covers its required set
   (set coverage, never element counts), its post-load processing runs on the staging tensors
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

import hashlib
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine_agent.errors import (
    AgentError,
    DerivedStateUnsupported,
    IdentityChanged,
    LoaderUnsupported,
    ShapeMismatch,
    UnknownTensor,
)
from engine_agent.reload.coverage import WHOLE, CoverageLedger, ShardKey
from engine_agent.reload.direct import DirectWrites
from engine_agent.reload.index import ModelIndex, ModuleEntry
from engine_agent.reload.inventory import Inventory
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
    """Routes ``model.load_weights`` into staging tensors and processes complete modules.

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
    ) -> None:
        self.index = index
        self.ledger = ledger
        self.device = device
        self.act_dtype = act_dtype
        self._before_live_write = before_live_write
        self._wrote_live = False
        self.inventory = inventory if inventory is not None else index.inventory()
        self._failpoint = failpoint
        #: derived items (inventory names) rebuilt in this session.
        self.rebuilt: set[str] = set()
        #: id(module) -> its real parameters while proxies are installed.
        self._originals: dict[int, dict[str, Any]] = {}
        #: sparse coordinate pass: (module, parameter) -> checkpoint positions, else None.
        self._coords: dict[tuple[str, str], torch.Tensor] | None = None
        self._staging: dict[str, dict[str, torch.Tensor]] = {}
        self.processed: set[str] = set()
        #: complete modules waiting for the owner of a parameter they share (:meth:`_complete`).
        self._deferred: dict[str, ModuleEntry] = {}
        self.derived_refreshed: list[str] = []
        self.module_digests: dict[str, str] = {}
        self.bytes_loaded = 0
        self._dry_keys: list[ShardKey] | None = None
        #: Watches loaders that write parameters themselves, while the proxies are installed.
        self._direct: DirectWrites | None = None
        #: seconds per processing step, summed over modules (digest, post_load, copy_live, ...).
        self.timings: dict[str, float] = {}
        #: module name -> its live parameters while templates are installed.
        self._live: dict[str, dict[str, Any]] = {}
        for name in sorted(ledger.modules):
            self._refuse_stale_sharers(name)

    @contextmanager
    def _timed(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[step] = self.timings.get(step, 0.0) + time.perf_counter() - started

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
        entries = {id(e.module): e for e in self.index.entries.values()}
        self._direct = DirectWrites(self._route_direct, self._refuse_direct)
        try:
            for name, module in self.index.model.named_modules():
                if not module._parameters:
                    continue
                saved.append((module, dict(module._parameters)))
                self._originals[id(module)] = saved[-1][1]
                entry = entries.get(id(module))
                templates = entry.templates if entry is not None else {}
                if entry is not None:
                    self._live[entry.name] = saved[-1][1]
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
                    _slots(module)[pname] = proxy
            yield
        finally:
            for module, params in saved:
                module._parameters.clear()
                module._parameters.update(params)
            self._live.clear()
            self._originals.clear()
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
            self._complete(entry)

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

    # -- processing of a complete module -------------------------------------------------

    def process(self, entry: ModuleEntry) -> None:
        """Run post-load processing on ``entry``'s staging and copy it into live storage."""
        if entry.name in self.index.unsupported:
            raise DerivedStateUnsupported(
                f"{entry.name}: {self.index.unsupported[entry.name]}", field=entry.name
            )
        staged = self._staging.pop(entry.name, {})
        module = entry.module
        installed = dict(module._parameters)
        live_params = {
            k: v for k, v in self._live.get(entry.name, module._parameters).items() if v is not None
        }
        live_buffers = {k: v for k, v in module._buffers.items() if v is not None}
        # A module's post-load step swaps its kernel (on CPU a new ``cpu_linear`` closure) on
        # the live module, and refreshers write live derived tensors: the rank is dirty from
        # here on, whatever fails next (issue 10, item 3).
        self._mark_dirty()
        try:
            # Post-load runs as at a cold load: on the module's real parameters (one it shares
            # with another module, as MiniMax-M2's experts share the block's routing bias, or
            # derived ones), with the staged checkpoint parameters in their slots. Left at the
            # load's meta guards, a shared parameter reached the copy back as a meta tensor and
            # every full update crashed after live writes (issue 26, item 5).
            module._parameters.clear()
            module._parameters.update(live_params)
            for pname, tensor in staged.items():
                _slots(module)[pname] = tensor
            try:
                self._failpoint("post_load.before")
                with self._timed("post_load"):
                    self._post_load(entry.name, module)
                self._failpoint("post_load.after")
                with self._timed("refresh_derived"):
                    for refresher in self.index.refreshers.get(entry.name, []):
                        # The owner's own parameters, not the load's guards: MLA registers
                        # W_UK_T/W_UV as parameters, and a refresher writing into a guard writes
                        # nothing (found with derived tensors that do not alias kv_b_proj).
                        with self._real_parameters(refresher.layer):
                            names = refresher.refresh(self.act_dtype)
                        self.derived_refreshed.extend(names)
                        self.rebuilt.update(names)
                self._failpoint("refresh.after")
            except AgentError:
                raise
            except Exception as e:  # a vLLM post-load step failed: name the module, not a loader
                raise AgentError(
                    f"post-load processing of {entry.name} failed: {type(e).__name__}: {e}",
                    field=entry.name,
                ) from e
            self._failpoint("copy.before")
            with self._timed("copy_live"):
                self._copy_into_live(entry, live_params, _present(module._parameters))
                self._copy_into_live(entry, live_buffers, _present(module._buffers))
        finally:
            # Back to what the load installed: a later tensor of this batch for this module
            # must meet the accounting (a duplicate), never the live parameter's own loader.
            module._parameters.clear()
            module._parameters.update(installed)
            for name, buffer in live_buffers.items():
                module._buffers[name] = buffer
        self._failpoint("copy.after")
        self.processed.add(entry.name)
        self._reprocess_sharers(entry)

    def _complete(self, entry: ModuleEntry) -> None:
        """Process a module whose staging covers its required shards, or hold it back.

        A module holding a parameter another module owns (MiniMax-M2's and DeepSeek-V3's
        experts hold the routing bias of their block or gate) is processed after that owner
        when the owner is updated in this session too, so its post-load step sees the new
        value — as at a cold load, where every module is processed after every load.
        """
        waiting = [
            owner
            for owner in self.index.owners_of(entry.name)
            if owner in self.ledger.modules and owner not in self.processed
        ]
        if waiting:
            self._deferred[entry.name] = entry
            return
        self.process(entry)

    def _refuse_stale_sharers(self, owner: str) -> None:
        """Refuse, at begin, to update a parameter an unreloaded module also holds.

        Only a module that is itself reloaded here can re-run its post-load step on checkpoint
        layout: re-running it on its live, already kernel-formatted weights (packed experts)
        would process them twice. Tied embeddings are not affected (the LM head has no
        checkpoint parameter of its own, and its post-load step reads the shared one).
        """
        for holder_name, _holder, pname in self.index.sharers.get(owner, []):
            if holder_name in self.index.entries and holder_name not in self.ledger.modules:
                raise DerivedStateUnsupported(
                    f"{owner}: its parameter {pname} is also held by {holder_name}, which "
                    f"this update does not reload; include {holder_name} in the update",
                    field=f"{holder_name}.{pname}",
                )

    def _mark_dirty(self) -> None:
        if not self._wrote_live:
            self._before_live_write()
            self._wrote_live = True

    def _post_load(self, name: str, module: nn.Module) -> None:
        """A module's own post-load step (quant method, experts' kernel format).

        Runs on whatever parameters the module holds now (staging, or live for sharers), and
        records which of its kernel objects it rebuilt.
        """
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        quant_method = getattr(module, "quant_method", None)
        if not isinstance(quant_method, QuantizeMethodBase):
            return
        if hasattr(module, "_already_called_process_weights_after_loading"):
            delattr(module, "_already_called_process_weights_after_loading")
        quant_method.process_weights_after_loading(module)
        self._replay_expert_kernel_format(name, module, quant_method)
        update_tp_status = getattr(module, "update_param_tp_status", None)
        if callable(update_tp_status):
            update_tp_status()
        self.rebuilt.update(self.inventory.rebuilt_since(name, module))

    def _reprocess_sharers(self, entry: ModuleEntry) -> None:
        """Re-run the post-load step of every other module holding ``entry``'s parameters.

        Tied embeddings: ``lm_head.weight is embed_tokens.weight``, and on CPU the LM head's
        GEMM kernel keeps its own packed copy of it, so updating the embedding must rebuild it.
        A holder that is itself reloaded in this session is processed from its own staging
        instead (:meth:`_complete`): now, if it was waiting for this owner, else when complete.
        """
        for holder_name, holder, pname in self.index.sharers.get(entry.name, []):
            if holder_name in self.index.entries and holder_name in self.ledger.modules:
                held = self._deferred.pop(holder_name, None)
                if held is not None:
                    self._complete(held)
                continue
            self._mark_dirty()
            with self._real_parameters(holder):
                shared = holder._parameters.get(pname)
                try:
                    self._failpoint("tied.before")
                    with self._timed("post_load"):
                        self._post_load(holder_name, holder)
                    if holder._parameters.get(pname) is not shared:
                        raise IdentityChanged(
                            f"{holder_name}.{pname}: the post-load step of a module sharing "
                            f"{entry.name}'s parameter replaced it; the tie would break",
                            field=f"{holder_name}.{pname}",
                        )
                    self.derived_refreshed.append(f"{holder_name}:post_load(shares {entry.name})")
                    self._failpoint("tied.after")
                except AgentError:
                    raise
                except Exception as e:
                    raise AgentError(
                        f"post-load processing of {holder_name} (sharing {entry.name}'s "
                        f"parameter) failed: {type(e).__name__}: {e}",
                        field=holder_name,
                    ) from e
                finally:
                    _slots(holder)[pname] = shared

    @contextmanager
    def _real_parameters(self, module: nn.Module) -> Iterator[None]:
        """Run with ``module``'s real parameters in its slots while a load has installed
        proxies and guards there (:meth:`_installed`); what the block leaves is what the load
        restores when it ends. Outside a load the module already holds its real parameters.
        """
        real = self._originals.get(id(module))
        if real is None:
            yield
            return
        installed = dict(module._parameters)
        module._parameters.clear()
        module._parameters.update(real)
        try:
            yield
        finally:
            real.clear()
            real.update(module._parameters)
            module._parameters.clear()
            module._parameters.update(installed)

    def _replay_expert_kernel_format(self, name: str, module: nn.Module, quant_method: Any) -> None:
        # vLLM's unquantized MoE method skips the experts' own post-load step on a weight update
        # (it only copies into the existing storage), so a CPU/FlashInfer experts kernel would
        # read checkpoint-layout bytes where it expects its packed layout. Replaying that step on
        # the staging tensors reproduces the first load exactly.
        fused = getattr(getattr(quant_method, "moe_kernel", None), "fused_experts", None)
        step = getattr(fused, "process_weights_after_loading", None)
        if callable(step):
            step(module)
            self.derived_refreshed.append(f"{name}:{type(fused).__name__}.kernel_format")

    @staticmethod
    def _copy_into_live(
        entry: ModuleEntry, live: Mapping[str, torch.Tensor], processed: Mapping[str, torch.Tensor]
    ) -> None:
        for name, target in live.items():
            new = processed.get(name)
            if new is None or new is target:
                continue
            if new.numel() == 0 and target.numel() == 0:
                continue  # a placeholder on both sides (weights moved into a kernel closure)
            if tuple(new.shape) != tuple(target.shape) or new.dtype != target.dtype:
                raise IdentityChanged(
                    f"{entry.name}.{name}: processed tensor {new.dtype}{list(new.shape)} does not "
                    f"fit live storage {target.dtype}{list(target.shape)}; the kernel layout "
                    "changed since the engine started",
                    field=f"{entry.name}.{name}",
                )
            target.data.copy_(new.data)

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
            self._mark_dirty()
            live = write.entry.module._parameters[write.param]
            assert live is not None
            local, values = write.local.to(live.device), write.values.to(live.device)
            live.data.view(-1).index_copy_(0, local, values)
            self.ledger.record(write.key)
            self.bytes_loaded += write.values.numel() * write.values.element_size()
            self._failpoint("sparse.after_write")
        for entry in {write.entry.name: write.entry for write in plan}.values():
            self._rebuild_in_place(entry)
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

    def _rebuild_in_place(self, entry: ModuleEntry) -> None:
        """Re-derive kernel state from a module's (patched) live weights."""
        quant_method = getattr(entry.module, "quant_method", None)
        if type(quant_method).__name__ == "UnquantizedEmbeddingMethod":
            self._post_load(entry.name, entry.module)
        for refresher in self.index.refreshers.get(entry.name, []):
            names = refresher.refresh(self.act_dtype)
            self.derived_refreshed.extend(names)
            self.rebuilt.update(names)
        self._reprocess_sharers(entry)
        with self._timed("digest"):
            self.module_digests[entry.name] = _digest_of(entry.live_tensors())
        self.processed.add(entry.name)

    def discard(self) -> None:
        """Drop every staging tensor (abort or failure): live storage is left as it is."""
        self._staging.clear()
        self._deferred.clear()


@dataclass(frozen=True, slots=True)
class _Direct:
    """A proxy's parameter, as :class:`~engine_agent.reload.direct.DirectWrites` reports it."""

    entry: ModuleEntry
    param: str
    template: torch.Tensor
    dry: bool


def _slots(module: nn.Module) -> dict[str, Any]:
    """A module's parameter slots, typed loosely: staging tensors are swapped in and out."""
    slots: dict[str, Any] = module._parameters
    return slots


def _present(tensors: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if v is not None}


def _digest_of(tensors: Mapping[str, torch.Tensor]) -> str:
    return hashlib.sha256(
        "".join(f"{p}:{tensor_digest(t)};" for p, t in sorted(tensors.items())).encode()
    ).hexdigest()


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
