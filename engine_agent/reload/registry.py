"""The one :class:`~engine_agent.reload.RankEngine` per model in this process (the rank registry).

A rank is updated along two paths: the worker extension's RPCs
(:mod:`engine_agent.vllm_extension`) and the weight-transfer backends (:mod:`engine_agent.transfer`,
built by vLLM, which hands them only the model and its config). Both ask
:func:`rank_engine_for`, so a rank has exactly one state machine whichever path touches it.

It sits here, below both callers, so neither has to import the other: the backends used to
reach it through the extension module, which itself imports the backends (an import cycle).
It imports neither of them.

The engine is built on first use from the worker's ``vllm_config``: this rank's position in the
parallel groups (:func:`rank_id`), the boot version (``WEIGHTROLL_BOOT_VERSION``), the guard
period (:data:`GUARD_PERIOD_ENV`), after :func:`check_vllm_version` has refused an unsupported
vLLM.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from packaging.version import InvalidVersion, Version

from engine_agent.protocol import RankId
from engine_agent.vllm_surface import SUPPORTED_VLLM

__all__ = ["GUARD_PERIOD_ENV", "check_vllm_version", "guard_period", "rank_engine_for", "rank_id"]


def check_vllm_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` is within :data:`SUPPORTED_VLLM`.

    Only the release's major.minor counts (PEP 440, parsed by ``packaging``): a release
    candidate, a dev build or a local build of an accepted minor (``0.33.0rc1``,
    ``0.34.1.dev5+g1234``, ``0.32.0+cpu``) is accepted, because the contact surface
    (docs/vllm-surface.md) is checked per minor release.

    Raises:
        RuntimeError: the version is outside the range, or not a PEP 440 version at all.
    """
    low, high = SUPPORTED_VLLM
    supported = f"weightroll supports vLLM {low[0]}.{low[1]} to <{high[0]}.{high[1]}"
    try:
        minor = Version(version).release[:2]
    except InvalidVersion as e:
        raise RuntimeError(f"{supported}, found {version!r} (not a PEP 440 version)") from e
    if not low <= minor < high:
        raise RuntimeError(f"{supported}, found {version}")


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


def rank_id(expert_parallel: bool = False, parallel_config: Any = None) -> RankId:
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


def _ranks_on_host(parallel_config: Any) -> int:
    """The replica's ranks on this node (vLLM's ``local_world_size``; its world size where
    that is missing: more, never fewer, so the prefetch bound errs towards refusing)."""
    for attr in ("local_world_size", "world_size"):
        value = getattr(parallel_config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1


# Weak keys: the registry must not keep a model vLLM has dropped (and its weights) alive.
_RANK_ENGINES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def rank_engine_for(model: Any, vllm_config: Any) -> Any:
    """The one :class:`~engine_agent.reload.RankEngine` of ``model`` in this process.

    Shared by the extension's RPCs and the weight-transfer backends (engine_agent/transfer), so
    a rank has exactly one state machine whichever path updates it.

    Raises:
        RuntimeError: on first use, an unsupported vLLM or an invalid :data:`GUARD_PERIOD_ENV`.
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
            rank=rank_id(
                bool(vllm_config.parallel_config.enable_expert_parallel),
                vllm_config.parallel_config,
            ),
            boot_version=os.environ.get("WEIGHTROLL_BOOT_VERSION", "boot"),
            guard_period=guard_period(os.environ.get(GUARD_PERIOD_ENV)),
            ranks_on_host=_ranks_on_host(vllm_config.parallel_config),
        )
        _RANK_ENGINES[model] = engine
    return engine
