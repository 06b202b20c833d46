"""Processing of a complete module: post-load on its staging, copy into live storage.

The router (:class:`engine_agent.reload.modelwise.LoadRouter`) writes every shard a loader
hands it into a per-module staging tensor in checkpoint layout and records its key in the
coverage ledger. When a module's staging covers its required set (set coverage, never element
counts), :meth:`ModuleProcessor.process` runs its post-load processing on the staging tensors
— quant method, the experts' kernel-format prepack, then every derived-state refresher sourced
from this module (MLA ``W_UK_T``/``W_UV``) — and ``copy_``-es the results into the live
tensors, so no kernel-visible address moves; then every other module holding one of its
parameter objects (tied embeddings) re-runs its own post-load step. After a sparse patch,
:meth:`ModuleProcessor.rebuild_in_place` re-derives the same kernel state from the patched live
weights.

The processor shares two mappings with the router, which owns and fills them: the staging
tensors (``module name -> parameter name -> tensor``; the processor pops a module's when it
processes it) and, while a load has proxies installed, each module's real parameters
(``id(module) -> parameter slots``). Everything else it reports (what it processed, rebuilt
and refreshed, digests, timings) is its own.

Invariants:
    * The rank is marked dirty (``before_live_write``) before the first kernel-visible change:
      a post-load step already swaps the live module's kernel (on CPU a new ``cpu_linear``
      closure), and a refresher writes live derived tensors.
    * A module that holds a parameter another updated module owns is processed after that
      owner, from its own staging (:meth:`ModuleProcessor.complete`); updating a parameter an
      unreloaded indexed module also holds is refused when the processor is built.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from engine_agent.errors import AgentError, DerivedStateUnsupported, IdentityChanged
from engine_agent.reload.coverage import CoverageLedger
from engine_agent.reload.index import ModelIndex, ModuleEntry
from engine_agent.reload.inventory import Inventory

__all__ = ["ModuleProcessor", "parameter_slots", "require_tie_kept"]


class ModuleProcessor:
    """Processes complete modules of one session and rebuilds patched ones in place.

    Args:
        index: the rank's model index.
        ledger: coverage ledger of the session (which modules this update reloads).
        inventory: the session's inventory (which kernel objects a post-load step rebuilt).
        act_dtype: the model's activation dtype (attention post-load processing needs it).
        before_live_write: called once, right before the first kernel-visible change (a
            module's post-load step, a refresher, a kernel swap or a live byte).
        failpoint: called at every step boundary with its name (tests; see
            :mod:`engine_agent.reload.failpoints`).
        staging: the router's staging tensors, ``module name -> parameter name -> tensor``.
        originals: the router's ``id(module) -> real parameters`` while proxies are installed.
        buffer_originals: the same for the real buffers of modules with checkpoint buffers.

    Raises:
        DerivedStateUnsupported: the update reloads a parameter that an indexed module it does
            not reload also holds.
    """

    #: Whether the router's staging may adopt the read buffers a loader copies whole
    #: (:mod:`.adopt`): only where the buffers are the rank's own and hashed (a prefetch).
    adopts_reads: ClassVar[bool] = False

    def __init__(
        self,
        index: ModelIndex,
        ledger: CoverageLedger,
        inventory: Inventory,
        act_dtype: torch.dtype,
        before_live_write: Callable[[], None],
        failpoint: Callable[[str], None],
        staging: dict[str, dict[str, torch.Tensor]],
        originals: dict[int, dict[str, Any]],
        buffer_originals: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        self.index = index
        self.ledger = ledger
        self.inventory = inventory
        self.act_dtype = act_dtype
        self._before_live_write = before_live_write
        self._wrote_live = False
        self._failpoint = failpoint
        self._staging = staging
        self._originals = originals
        self._buffer_originals = buffer_originals if buffer_originals is not None else {}
        #: derived items (inventory names) rebuilt in this session.
        self.rebuilt: set[str] = set()
        self.processed: set[str] = set()
        #: complete modules waiting for the owner of a parameter they share (:meth:`complete`).
        self._deferred: dict[str, ModuleEntry] = {}
        self.derived_refreshed: list[str] = []
        self.module_digests: dict[str, str] = {}
        #: seconds per processing step, summed over modules (digest, post_load, copy_live, ...).
        self.timings: dict[str, float] = {}
        for name in sorted(ledger.modules):
            self._refuse_stale_sharers(name)

    @contextmanager
    def _timed(self, step: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.timings[step] = self.timings.get(step, 0.0) + time.perf_counter() - started

    def process(self, entry: ModuleEntry) -> None:
        """Run post-load processing on ``entry``'s staging and copy it into live storage."""
        if entry.name in self.index.unsupported:
            raise DerivedStateUnsupported(
                f"{entry.name}: {self.index.unsupported[entry.name]}", field=entry.name
            )
        staged = self._staging.pop(entry.name, {})
        module = entry.module
        installed = dict(module._parameters)
        installed_buffers = dict(module._buffers)
        live_params = {
            k: v
            for k, v in self._originals.get(id(module), module._parameters).items()
            if v is not None
        }
        live_buffers = {
            k: v
            for k, v in self._buffer_originals.get(id(module), module._buffers).items()
            if v is not None
        }
        # A module's post-load step swaps its kernel (on CPU a new ``cpu_linear`` closure) on
        # the live module, and refreshers write live derived tensors: the rank is dirty from
        # here on, whatever fails next (issue 10, item 3).
        self.mark_dirty()
        try:
            # Post-load runs as at a cold load: on the module's real parameters (one it shares
            # with another module, as MiniMax-M2's experts share the block's routing bias, or
            # derived ones), with the staged checkpoint parameters in their slots. Left at the
            # load's meta guards, a shared parameter reached the copy back as a meta tensor and
            # every full update crashed after live writes (issue 26, item 5).
            module._parameters.clear()
            module._parameters.update(live_params)
            module._buffers.update(live_buffers)
            for pname, tensor in staged.items():
                # A checkpoint buffer (XIELU's ``beta``) is staged into its buffer slot.
                slots = module._buffers if pname in live_buffers else parameter_slots(module)
                slots[pname] = tensor
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
                self._copy_into_live(entry.name, live_params, _present(module._parameters))
                self._copy_into_live(entry.name, live_buffers, _present(module._buffers))
        finally:
            # Back to what the load installed: a later tensor of this batch for this module
            # must meet the accounting (a duplicate), never the live parameter's own loader.
            module._parameters.clear()
            module._parameters.update(installed)
            module._buffers.clear()
            module._buffers.update(installed_buffers)
        self._failpoint("copy.after")
        self.processed.add(entry.name)
        self._reprocess_sharers(entry)

    def process_staged(self, entry: ModuleEntry, staged: dict[str, torch.Tensor]) -> None:
        """Process ``entry`` from tensors staged elsewhere (a prefetch's, routed before the
        drain), as if the router had just completed it."""
        self._staging[entry.name] = staged
        self.complete(entry)

    def complete(self, entry: ModuleEntry) -> None:
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

    def mark_dirty(self) -> None:
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
        instead (:meth:`complete`): now, if it was waiting for this owner, else when complete.
        """
        for holder_name, holder, pname in self.index.sharers.get(entry.name, []):
            if holder_name in self.index.entries and holder_name in self.ledger.modules:
                held = self._deferred.pop(holder_name, None)
                if held is not None:
                    self.complete(held)
                continue
            self.mark_dirty()
            with self._real_parameters(holder):
                shared = holder._parameters.get(pname)
                try:
                    self._failpoint("tied.before")
                    with self._timed("post_load"):
                        self._post_load(holder_name, holder)
                    require_tie_kept(holder_name, holder, pname, shared, entry.name)
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
                    parameter_slots(holder)[pname] = shared

    @contextmanager
    def _real_parameters(self, module: nn.Module) -> Iterator[None]:
        """Run with ``module``'s real parameters in its slots while a load has installed
        proxies and guards there (``LoadRouter._installed``); what the block leaves is what the
        load restores when it ends. Outside a load the module already holds its real parameters.
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
        module: str, live: Mapping[str, torch.Tensor], processed: Mapping[str, torch.Tensor]
    ) -> None:
        for name, target in live.items():
            new = processed.get(name)
            if new is None or new is target:
                continue
            if new.numel() == 0 and target.numel() == 0:
                continue  # a placeholder on both sides (weights moved into a kernel closure)
            if tuple(new.shape) != tuple(target.shape) or new.dtype != target.dtype:
                raise IdentityChanged(
                    f"{module}.{name}: processed tensor {new.dtype}{list(new.shape)} does not "
                    f"fit live storage {target.dtype}{list(target.shape)}; the kernel layout "
                    "changed since the engine started",
                    field=f"{module}.{name}",
                )
            target.data.copy_(new.data)

    def rebuild_in_place(self, entry: ModuleEntry) -> None:
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
        """Forget the modules held back for an owner (abort or failure)."""
        self._deferred.clear()


def require_tie_kept(
    holder_name: str, holder: nn.Module, pname: str, shared: Any, owner: str
) -> None:
    """Refuse a sharer's post-load step that replaced the parameter it shares with ``owner``.

    Raises:
        IdentityChanged: the tie would break (the holder would keep its own, stale copy).
    """
    if holder._parameters.get(pname) is not shared:
        raise IdentityChanged(
            f"{holder_name}.{pname}: the post-load step of a module sharing {owner}'s "
            "parameter replaced it; the tie would break",
            field=f"{holder_name}.{pname}",
        )


def parameter_slots(module: nn.Module) -> dict[str, Any]:
    """A module's parameter slots, typed loosely: staging tensors are swapped in and out."""
    slots: dict[str, Any] = module._parameters
    return slots


def _present(tensors: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if v is not None}


def _digest_of(tensors: Mapping[str, torch.Tensor]) -> str:
    from engine_agent.reload.digest import tensor_digest

    return hashlib.sha256(
        "".join(f"{p}:{tensor_digest(t)};" for p, t in sorted(tensors.items())).encode()
    ).hexdigest()
