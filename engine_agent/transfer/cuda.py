"""``weightroll_nccl`` and ``weightroll_ipc``: vLLM's CUDA engines behind the verified session.

Subclasses of ``NCCLWeightTransferEngine`` and ``IPCWeightTransferEngine`` that keep their init
and update info classes (so an unmodified ``NCCLTrainerWeightTransferEngine`` /
``IPCTrainerWeightTransferEngine`` talks to them) and their receive code (NCCL broadcast, packed
buffers, IPC handles); only the lifecycle changes (:class:`~.backend.VerifiedBackendMixin`):
the layerwise reload is replaced by the verified session.

Limitations: CUDA only, and not run in this project's CI (no GPU). On CPU the modules import
and the classes build, which is what the unit tests check.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from engine_agent.transfer.backend import VerifiedBackendMixin

__all__ = ["WeightrollIPCEngine", "WeightrollNCCLEngine"]


class WeightrollNCCLEngine(VerifiedBackendMixin, NCCLWeightTransferEngine):
    """vLLM's dense NCCL engine (packed or not) feeding the verified session."""

    def receive_weights(self, update_info: Any) -> None:
        self.receive_through_feeder(super().receive_weights, update_info)


class WeightrollIPCEngine(VerifiedBackendMixin, IPCWeightTransferEngine):
    """vLLM's CUDA IPC engine feeding the verified session."""

    repeats_metadata = False

    def receive_weights(self, update_info: Any) -> None:
        self.receive_through_feeder(super().receive_weights, update_info)
