"""weightroll's weight-transfer backends: vLLM's native trainer routes with the verified session.

vLLM's RL surface (``/start_weight_update`` → ``/update_weights`` → ``/finish_weight_update``)
builds a ``WeightTransferEngine`` per worker from ``--weight-transfer-config
'{"backend": NAME}'``. This package registers three backend names (the public interface):

``weightroll_nccl``
    vLLM's dense NCCL engine with its own init/update info classes, so an unmodified
    ``NCCLTrainerWeightTransferEngine`` (trainer backend key ``nccl``) talks to it.
``weightroll_ipc``
    vLLM's CUDA IPC engine, likewise (trainer key ``ipc``).
``weightroll_gloo``
    A CPU transport over ``torch.distributed`` Gloo with a TCPStore rendezvous; its trainer
    side is registered in ``WeightTransferTrainerFactory`` under the same name.

All three route every received tensor through the rank's verified session
(:mod:`engine_agent.reload`): ``start`` opens a full session, each tensor goes through the same
per-shard coverage ledger, duplicate refusal, staging and derived-state refresh as a file load,
and ``finish`` commits only if coverage is complete and identity unchanged — otherwise it raises,
so the trainer's HTTP call fails. See :mod:`engine_agent.transfer.verified` for the semantics.

Registration (:func:`register_backends`) is idempotent and happens in every worker process:
importing :mod:`engine_agent.vllm_extension` (the ``--worker-extension-cls`` module) calls it, and
so does the ``vllm.general_plugins`` entry point ``weightroll`` (pyproject.toml). Engines are
registered by module path, so nothing CUDA-specific is imported until vLLM builds one.

Limitations: draft-model updates (``/start_draft_weight_update``) are refused; IPC and NCCL are
not exercised in this project's CI (no GPU); the Gloo path is.
"""

from __future__ import annotations

import contextlib
from typing import Final

__all__ = ["BACKENDS", "TRAINER_BACKENDS", "register_backends"]

#: Worker-side backends: name → (module, class).
BACKENDS: Final[dict[str, tuple[str, str]]] = {
    "weightroll_nccl": ("engine_agent.transfer.cuda", "WeightrollNCCLEngine"),
    "weightroll_ipc": ("engine_agent.transfer.cuda", "WeightrollIPCEngine"),
    "weightroll_gloo": ("engine_agent.transfer.gloo", "GlooWeightTransferEngine"),
}
#: Trainer-side backends registered in ``WeightTransferTrainerFactory``.
TRAINER_BACKENDS: Final[dict[str, tuple[str, str]]] = {
    "weightroll_gloo": ("engine_agent.transfer.gloo", "GlooTrainerWeightTransferEngine"),
}


def register_backends() -> None:
    """Register weightroll's backends with vLLM's factories (idempotent; plugin entry point).

    A name that is already registered is left as it is (plugins load more than once per
    process). Without vLLM installed this does nothing.
    """
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
            WeightTransferTrainerFactory,
        )
    except ImportError:  # the sidecar image, or a trainer without vLLM
        return
    for factory, table in (
        (WeightTransferEngineFactory, BACKENDS),
        (WeightTransferTrainerFactory, TRAINER_BACKENDS),
    ):
        for name, (module, cls) in table.items():
            with contextlib.suppress(ValueError):  # already registered: idempotent
                factory.register_engine(name, module, cls)
