"""Post-load processing on shadow modules while the replica serves (issue 30, the drained window).

A prefetched update used to route, post-process and copy every module inside the drain; on CPU
the post-load step (vLLM's packing of each linear's weight for its oneDNN or sgl GEMM kernel)
was about 60 % of the window. None of it needs the live tensors: vLLM's CPU GEMM dispatch
(``dispatch_cpu_unquantized_gemm``) builds a new kernel closure over a *copy* of the weight —
oneDNN reorders it into a handle the closure keeps, the sgl path keeps a packed tensor, and with
``remove_weight`` the parameter itself is replaced by an empty placeholder. So during the
prefetch each complete module is processed on a **shadow**: a second object of the module's
class sharing every attribute of the live one except its parameter and buffer slots, which hold
the staged checkpoint bytes (and private copies of any other tensor of the module). Whatever the
post-load step produces lands on the shadow. Inside the drain :meth:`ShadowModule.install` only
``copy_``-es the shadow's tensors into the live storage (no ``data_ptr`` moves) and hands the
shadow's kernel objects (the ``cpu_linear`` closure) to the live module — the same state a
post-load step on the live module would have left, computed while the replica served.

Where a shadow is not safe the module is processed inside the drain, as a ``load`` does, and the
reason is kept (:attr:`ShadowProcessor.in_window`):

* a quant method other than the unquantized linear and embedding methods: their post-load
  steps are known to write only the layer's own slots and kernel attribute; others (MoE
  experts, quantized kernels) can keep state on shared kernel objects (an experts' kernel object
  holds its packed layout), which a shadow would write while the live one serves;
* a derived-state refresher sourced from the module (MLA ``W_UK_T``/``W_UV``, CPU conv1d
  prepack): refreshers write the live owner's tensors in place;
* a parameter another module owns (experts holding their block's routing bias): it must be
  processed after that owner's live bytes changed;
* a module holding one of its parameters (tied LM head) whose quant method is not one of the
  two above.

Invariants:
    * Nothing here touches a live tensor or a live module's attribute before :meth:`install`;
      a failure while preparing leaves the rank as it was (the prefetch fails, the rank serves).
    * :meth:`ShadowModule.install` marks the rank dirty before its first live change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import torch
from torch import nn

from engine_agent.errors import AgentError, IdentityChanged
from engine_agent.reload.coverage import ShardKey
from engine_agent.reload.index import ModuleEntry
from engine_agent.reload.prefetch import Prefetch
from engine_agent.reload.processing import ModuleProcessor, require_tie_kept

__all__ = [
    "PREPARE_BATCH_BYTES",
    "PREPARE_POLL_BYTES",
    "SHADOW_SAFE_METHODS",
    "Prepared",
    "ShadowModule",
    "ShadowProcessor",
    "prepare",
]

logger = logging.getLogger(__name__)

#: While a prefetch still reads, a poll routes and post-processes what was read once at least
#: this much is waiting (every routing call swaps the whole model's parameter slots).
PREPARE_BATCH_BYTES: Final = 64 << 20
#: At most this much per poll: the engine does not step during one, and the agent's poll has
#: its control timeout (30 s by default); the next poll goes on.
PREPARE_POLL_BYTES: Final = 1 << 30

#: Quant methods whose post-load step writes only the layer's own parameter slots and kernel
#: attribute (vLLM 0.32: ``dispatch_cpu_unquantized_gemm`` on CPU, nothing on CUDA).
SHADOW_SAFE_METHODS: Final = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
_SLOTS: Final = ("_parameters", "_buffers", "_modules")


@dataclass(slots=True)
class ShadowModule:
    """One module processed on a shadow, waiting for the drain.

    ``shares``: the parameter it holds of another module (a tied LM head holds the embedding's
    weight); that parameter is the owner's and is copied by the owner's install, never here.
    ``before``: the shadow's attributes before its post-load step, so the install hands over
    only what that step set or removed (an attribute the live module changed since, at run
    time, is left as the live module has it).
    """

    name: str
    live: nn.Module
    shadow: nn.Module
    before: dict[str, Any]
    shares: str | None = None
    derived: list[str] = field(default_factory=list)

    def install(self, mark_dirty: Callable[[], None], failpoint: Callable[[str], None]) -> None:
        """Copy the shadow's tensors into the live storage and hand over its kernel objects."""
        live, shadow = self.live, self.shadow
        mark_dirty()
        failpoint("copy.before")
        for slots in ("_parameters", "_buffers"):
            targets = {
                k: v for k, v in live.__dict__[slots].items() if v is not None and k != self.shares
            }
            processed = {k: v for k, v in shadow.__dict__[slots].items() if v is not None}
            _copy_into_live(self.name, targets, processed)
        for key, value in shadow.__dict__.items():
            if key in _SLOTS or self.before.get(key, _MISSING) is value:
                continue
            current = live.__dict__.get(key, _MISSING)
            if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
                _copy_into_live(self.name, {key: current}, {key: value})
            else:  # the kernel (on CPU a new ``cpu_linear`` closure over its packed copy)
                live.__dict__[key] = value
        for key in self.before.keys() - shadow.__dict__.keys():
            live.__dict__.pop(key, None)  # what the post-load step removed ("already called")
        failpoint("copy.after")


_MISSING: Final = object()


@dataclass(slots=True)
class Prepared:
    """A prefetch's routed and processed update, waiting for the drain.

    ``keys``: every shard key its routing wrote (checked against the session's ledger when
    applied); ``processor``: its shadows and the modules left to the drain.
    """

    keys: list[ShardKey]
    processor: ShadowProcessor
    bytes_loaded: int
    #: Of ``bytes_loaded``, those staged in the read buffers themselves (:mod:`.adopt`).
    bytes_adopted: int = 0
    #: What the commit's seal must record for the tensors and kernels the shadows hand over
    #: (:meth:`StillTrueGuard.seal`), digested before the drain; empty where modules are left
    #: to the drain (their processing may write any live tensor).
    digests: dict[str, str] = field(default_factory=dict)

    def digest_shadows(self) -> None:
        """Collect, before the drain, the digests of what each shadow will put in live storage
        (:meth:`ShadowProcessor.seal_digests`): its tensors (the bytes the install copies) and
        what its kernel computes on the guard's probe."""
        if self.processor.in_window:
            self.processor.stop_digests()
            return
        self.digests = self.processor.seal_digests()

    @property
    def in_window(self) -> dict[str, str]:
        """Modules processed inside the drain, each with the reason (module doc)."""
        return {name: reason for name, (_e, _s, reason) in self.processor.in_window.items()}

    def apply(self, real: ModuleProcessor, failpoint: Callable[[str], None]) -> None:
        """Inside the drain: record the keys in the session's ledger, install every shadow, then
        process the modules left to the drain from their staging (:class:`ModuleProcessor`)."""
        real.ledger.check(self.keys)
        for key in self.keys:
            real.ledger.record(key)
        for shadow in self.processor.shadows:
            shadow.install(real.mark_dirty, failpoint)
            if shadow.shares is None:
                real.processed.add(shadow.name)
            real.rebuilt.update(real.inventory.rebuilt_since(shadow.name, shadow.live))
            real.derived_refreshed.extend(shadow.derived)
        left = self.processor.in_window
        for entry, staged, _reason in left.values():
            real.process_staged(entry, staged)
        self.processor.discard()


def _copy_into_live(
    module: str, live: dict[str, torch.Tensor], processed: dict[str, torch.Tensor]
) -> None:
    """Copy, then prove the live bytes are the shadow's: the commit's seal records the
    shadows' digests (taken before the drain), not a hash of the live bytes, so the copy itself
    is checked here, inside the drain, before anything is committed. A compare reads both
    tensors once, cheaper than hashing the live bytes again."""
    ModuleProcessor._copy_into_live(module, live, processed)
    for name, target in live.items():
        new = processed.get(name)
        if new is None or new is target or new.numel() == 0:
            continue
        if not _same_bytes(target, new):
            raise IdentityChanged(
                f"{module}.{name}: the live bytes differ from the prefetched ones after the copy",
                field=f"{module}.{name}",
            )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals the same NaN; ``torch.equal`` alone says it does not).

    Compared as the widest integers both tensors' bytes split into: ``torch.equal`` on bytes
    runs about 7x slower than on 8-byte words (CPU), and this runs inside the drain."""
    if a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype:
        x, y = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        word = next((w for w in _WORDS if _fits(x, w) and _fits(y, w)), torch.uint8)
        return torch.equal(x.view(word), y.view(word))
    return bool(torch.equal(a, b))


_WORDS: Final = (torch.int64, torch.int32, torch.int16)


def _fits(raw: torch.Tensor, word: torch.dtype) -> bool:
    """Whether a row of bytes can be read as ``word``s (its size and address divide)."""
    size = word.itemsize
    return all(n % size == 0 for n in (raw.numel(), raw.storage_offset(), raw.data_ptr()))


class ShadowProcessor(ModuleProcessor):
    """A :class:`ModuleProcessor` for the prefetch: processes complete modules on shadows.

    Used by a router that loads the prefetched tensors into staging between two engine steps;
    it never marks the rank dirty (the router's ``before_live_write`` must not be reached).
    Its staging adopts the prefetch's read buffers where a loader copies one whole
    (:mod:`.adopt`): they are the rank's own, hashed while they are routed.
    """

    adopts_reads: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Modules processed on a shadow, in the order they completed (installed in it).
        self.shadows: list[ShadowModule] = []
        #: Modules left to the drain: name -> (entry, its staging, why no shadow).
        self.in_window: dict[str, tuple[ModuleEntry, dict[str, torch.Tensor], str]] = {}
        #: The seal's digests of each finished shadow, taken on a thread of their own while
        #: the next modules are routed and post-processed (:meth:`seal_digests`).
        self._digesting: ThreadPoolExecutor | None = None
        self._digests: list[Future[tuple[dict[str, str], float]]] = []

    def process(self, entry: ModuleEntry) -> None:
        reason = self._window_reason(entry)
        staged = self._staging.pop(entry.name, {})
        self.processed.add(entry.name)
        if reason is not None:
            self.in_window[entry.name] = (entry, staged, reason)
            self.stop_digests()  # the seal digests live bytes then (:attr:`Prepared.digests`)
        else:
            finished = len(self.shadows)
            self._process_on_shadow(entry, staged)
            if not self.in_window:
                self._digest_later(self.shadows[finished:])
        # Reloaded modules holding one of its parameters waited for it (:meth:`complete`);
        # they hold another's parameter, so they go to the drain, after this one.
        for holder_name, _holder, _pname in self.index.sharers.get(entry.name, []):
            held = self._deferred.pop(holder_name, None)
            if held is not None:
                self.complete(held)

    def _process_on_shadow(self, entry: ModuleEntry, staged: dict[str, torch.Tensor]) -> None:
        shadow = self._shadow(entry.module, staged)
        before = dict(shadow.__dict__)
        try:
            self._failpoint("prefetch.post_load")
            with self._timed("post_load"):
                self._post_load(entry.name, shadow)
                self.shadows.append(ShadowModule(entry.name, entry.module, shadow, before))
                self._shadow_sharers(entry, shadow)
        except AgentError:
            raise
        except Exception as e:  # a vLLM post-load step failed: name the module, not a loader
            raise AgentError(
                f"post-load processing of {entry.name} (prefetched) failed: "
                f"{type(e).__name__}: {e}",
                field=entry.name,
            ) from e

    def _window_reason(self, entry: ModuleEntry) -> str | None:
        """Why ``entry`` cannot be processed on a shadow (``None``: it can); module doc."""
        if entry.name in self.index.unsupported:
            return "its derived state is unsupported (refused when processed)"
        if self.index.refreshers.get(entry.name):
            return "a derived-state refresher writes its owner's live tensors"
        owners = sorted(self.index.owners_of(entry.name))
        if owners:
            return f"it holds a parameter of {owners[0]}, processed after that owner's live write"
        unsafe = _unsafe_method(entry.module)
        if unsafe is not None:
            return unsafe
        for holder_name, holder, _pname in self.index.sharers.get(entry.name, []):
            if holder_name in self.index.entries:
                continue  # an indexed holder is processed from its own staging
            unsafe = _unsafe_method(holder)
            if unsafe is not None:
                return f"{holder_name}, which holds its parameter: {unsafe}"
        return None

    def _shadow(
        self, module: nn.Module, staged: dict[str, torch.Tensor], shared: str | None = None
    ) -> nn.Module:
        """A second object of ``module``'s class: the same attributes, its own slots.

        Slots not staged hold private copies of the live tensors (the post-load step may write
        into any tensor it is handed); ``shared`` names a slot that already holds another
        shadow's tensor.
        """
        real = self._originals.get(id(module), module._parameters)
        real_buffers = self._buffer_originals.get(id(module), module._buffers)
        shadow = object.__new__(type(module))
        shadow.__dict__.update(module.__dict__)
        shadow.__dict__["_parameters"] = {
            k: _private(v) for k, v in real.items() if k != shared and k not in staged
        }
        shadow.__dict__["_buffers"] = {
            k: _private(v) for k, v in real_buffers.items() if k not in staged
        }
        shadow.__dict__["_modules"] = dict(module._modules)
        for pname, tensor in staged.items():
            slots = shadow.__dict__["_buffers" if pname in real_buffers else "_parameters"]
            slots[pname] = tensor
        return shadow

    def _shadow_sharers(self, entry: ModuleEntry, owner: nn.Module) -> None:
        """Process every unindexed module holding one of ``entry``'s parameters (the tied LM
        head) on a shadow holding the owner's processed tensor."""
        for holder_name, holder, pname in self.index.sharers.get(entry.name, []):
            if holder_name in self.index.entries:
                continue
            tensor = owner._parameters.get(pname)
            if tensor is None:
                raise IdentityChanged(
                    f"{entry.name}.{pname}: its post-load step removed a parameter "
                    f"{holder_name} shares",
                    field=f"{holder_name}.{pname}",
                )
            shadow = self._shadow(holder, {pname: tensor}, shared=pname)
            before = dict(shadow.__dict__)
            self._post_load(holder_name, shadow)
            require_tie_kept(holder_name, shadow, pname, tensor, entry.name)
            self.shadows.append(
                ShadowModule(
                    holder_name,
                    holder,
                    shadow,
                    before,
                    shares=pname,
                    derived=[f"{holder_name}:post_load(shares {entry.name})"],
                )
            )

    def _digest_later(self, shadows: list[ShadowModule]) -> None:
        """Digest ``shadows`` on the digest thread: their post-load steps (the owner's and
        its sharers') are done, and nothing writes a shadow's tensors or kernel after them
        (a later duplicate shard is refused before it is written), so the bytes digested now
        are the bytes the install copies; the install then proves the copy (``_copy_into_live``).
        On two cores this fills the core the read and hash threads leave idle once the read
        ended, instead of digesting every shadow after the last post-load step."""
        if self._digesting is None:
            self._digesting = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="weightroll-seal-digest"
            )
        for shadow in shadows:
            self._digests.append(self._digesting.submit(_shadow_digests, shadow, self._failpoint))

    def seal_digests(self) -> dict[str, str]:
        """Every shadow's seal digests (waits for the digest thread; re-raises its failure)."""
        try:
            digests: dict[str, str] = {}
            spent = 0.0
            for future in self._digests:
                done, seconds = future.result()
                digests |= done
                spent += seconds
            self.timings["seal_digests_overlapped"] = spent
            return digests
        finally:
            self.stop_digests()

    def stop_digests(self) -> None:
        """Stop the digest thread (what it has not started is dropped)."""
        executor, self._digesting, futures, self._digests = self._digesting, None, self._digests, []
        for future in futures:
            future.cancel()
        if executor is not None:
            executor.shutdown(wait=True)

    def mark_dirty(self) -> None:
        raise AgentError("a prefetch reached a live write; refused (a bug, reported)")

    def discard(self) -> None:
        super().discard()
        self.stop_digests()
        self.shadows.clear()
        self.in_window.clear()


def _shadow_digests(
    shadow: ShadowModule, failpoint: Callable[[str], None]
) -> tuple[dict[str, str], float]:
    """What the commit's seal must record for ``shadow`` once installed: a digest of each of
    its tensors and of what its kernel computes on the guard's probe (and the seconds taken).
    Runs on the digest thread; what it raises fails the prefetch (:meth:`seal_digests`)."""
    from engine_agent.reload.digest import tensor_digest
    from engine_agent.reload.guard import PROBED, kernel_probe

    failpoint("prefetch.seal_digest")
    started = time.perf_counter()
    digests: dict[str, str] = {}
    for slots in ("_parameters", "_buffers"):
        for pname, tensor in shadow.shadow.__dict__[slots].items():
            if tensor is not None and not tensor.is_meta and tensor.numel():
                digests[f"{shadow.name}.{pname}"] = tensor_digest(tensor)
    observed = kernel_probe(shadow.shadow)
    if observed is not None:
        digests[f"{shadow.name}{PROBED}"] = tensor_digest(observed)
    return digests, time.perf_counter() - started


def _unsafe_method(module: nn.Module) -> str | None:
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    method = getattr(module, "quant_method", None)
    if not isinstance(method, QuantizeMethodBase):
        return None  # no post-load step: the shadow only carries the staged bytes
    if type(method).__name__ in SHADOW_SAFE_METHODS:
        return None
    return f"its post-load step ({type(method).__name__}) may keep state outside the module"


def _private(tensor: Any) -> Any:
    """A copy of a live tensor for a shadow's slot, of the same class and attributes."""
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
        return tensor
    copy = torch.empty_like(tensor)
    copy.copy_(tensor)
    copy.__class__ = tensor.__class__
    copy.__dict__ = tensor.__dict__.copy()
    return copy


def prepare(staging: Prefetch, open_session: Callable[[], Any]) -> Prepared | None:
    """Route what ``staging`` read so far into per-module staging and run each complete
    module's post-load step on a shadow; once the read is ready, finish: coverage, the seal's
    digests, ``staging.prepared`` (returned; ``None`` while the read goes on or read tensors
    wait: at most :data:`PREPARE_POLL_BYTES` are prepared per call).

    Runs inside an RPC, between two engine steps: the live model is untouched (its parameter
    slots hold the router's proxies only while the routing runs), and the read goes on on its
    own thread meanwhile. ``open_session`` opens the session whose router (with a
    :class:`ShadowProcessor`) the preparation loads into, without changing the rank's state.
    """
    ready = staging.status == "ready"  # before taking: nothing is appended after ready
    if not ready and staging.pending_bytes < PREPARE_BATCH_BYTES:
        return None  # each routing installs the model's proxies: not for a few tensors
    started = time.perf_counter()
    try:
        if staging.preparing is None:
            staging.preparing = open_session()
        probe = staging.preparing
        taken = staging.take(PREPARE_POLL_BYTES)
        if taken:
            probe.router.load(taken)
        if not ready or staging.pending_bytes:
            return None
        probe.ledger.require_complete()
        processor = probe.router.processing
        assert isinstance(processor, ShadowProcessor)
        prepared = Prepared(
            probe.ledger.received(),
            processor,
            probe.router.bytes_loaded,
            probe.router.bytes_adopted,
        )
        digests_started = time.perf_counter()
        prepared.digest_shadows()
        # the wait for the digest thread (its own seconds: ``prefetch_seal_digests_overlapped``)
        staging.timings["prefetch_seal_digests"] = round(time.perf_counter() - digests_started, 6)
        staging.timings["prefetch_seal_digests_overlapped"] = round(
            processor.timings.get("seal_digests_overlapped", 0.0), 6
        )
        staging.prepared, staging.preparing = prepared, None
    finally:
        spent = staging.timings.get("prefetch_prepare", 0.0) + time.perf_counter() - started
        staging.timings["prefetch_prepare"] = round(spent, 6)
    staging.timings["prefetch_post_load"] = round(processor.timings.get("post_load", 0.0), 6)
    logger.info(
        "Prefetch of %s prepared: %d bytes staged, %d of them in the read buffers (not copied)",
        staging.spec.update_id,
        prepared.bytes_loaded,
        prepared.bytes_adopted,
    )
    for name, reason in prepared.in_window.items():
        logger.info(
            "Prefetch of %s: %s is processed in the drain: %s", staging.spec.update_id, name, reason
        )
    return prepared
