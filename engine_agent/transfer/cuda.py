"""``weightroll_nccl`` and ``weightroll_ipc``: vLLM's CUDA engines behind the verified session.

Subclasses of ``NCCLWeightTransferEngine`` and ``IPCWeightTransferEngine`` that keep their init
and update info classes (so an unmodified ``NCCLTrainerWeightTransferEngine`` /
``IPCTrainerWeightTransferEngine`` talks to them) and their receive code (NCCL broadcast, packed
buffers, IPC handles); only the lifecycle changes (:class:`~.backend.VerifiedBackendMixin`):
the layerwise reload is replaced by the verified session.

Rendezvous without code execution: vLLM's NCCL worker joins the trainer through
``StatelessProcessGroup``, whose ``broadcast_obj`` **unpickles** whatever the store at
``master_address`` holds, so whoever names that address runs code in every worker. Here the
address must first lie in the worker's trainer networks (``check_rendezvous``), and the
worker then reads the trainer's published NCCL unique id itself, as a plain TCPStore client,
decoding the pickle with an unpickler that admits only the two globals a ``ncclUniqueId``
pickle names (no callable of the peer's choosing runs), and joins with
``PyNcclCommunicator.from_unique_id_bytes``: the same handshake, so an unmodified
``NCCLTrainerWeightTransferEngine`` still talks to it. The pre-shared unique-id mode
(``nccl_unique_id_b64``) is refused: its bootstrap address cannot be checked. IPC refuses
pickled handles (``ipc_handles_pickled``) whatever ``VLLM_ALLOW_INSECURE_SERIALIZATION`` says.

Limitations: CUDA only, and not run in this project's CI (no GPU). On CPU the modules import
and the classes build, which is what the unit tests check.
"""

from __future__ import annotations

import datetime
import io
import pickle
from dataclasses import asdict
from typing import Any, Final

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]
from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from engine_agent.transfer.backend import VerifiedBackendMixin
from engine_agent.transfer.rendezvous import RendezvousRefused, check_update_info

__all__ = ["WeightrollIPCEngine", "WeightrollNCCLEngine", "nccl_unique_id"]

#: Where rank 0's first ``StatelessProcessGroup.broadcast_obj`` (the NCCL unique id) lies.
UNIQUE_ID_KEY: Final = "broadcast_from/0/0"
#: vLLM's ``StatelessProcessGroup.create`` default store timeout.
STORE_TIMEOUT_S: Final = 300.0
_UNIQUE_ID_BYTES: Final = 128
_UNIQUE_ID_CLASS: Final = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")


class _UniqueIdClass:
    """Stands in for ``ncclUniqueId`` while decoding: never instantiated."""


def _ctypes_state(cls: Any, state: Any) -> tuple[Any, Any]:
    """Stands in for ``_ctypes._unpickle``: returns its arguments, builds nothing."""
    return cls, state


class _UniqueIdUnpickler(pickle.Unpickler):
    """Admits only the globals of a pickled ``ncclUniqueId``, each replaced by a stand-in."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_ctypes", "_unpickle"):
            return _ctypes_state
        if (module, name) == _UNIQUE_ID_CLASS:
            return _UniqueIdClass
        raise pickle.UnpicklingError(f"the NCCL unique id may not name {module}.{name}")


def nccl_unique_id(published: bytes) -> bytes:
    """The 128 bytes of the ``ncclUniqueId`` a trainer published through vLLM's
    ``StatelessProcessGroup.broadcast_obj`` (a pickle), decoded without running anything the
    peer named.

    Raises:
        RendezvousRefused: ``rendezvous_not_allowed``, when it is anything else.
    """
    try:
        value = _UniqueIdUnpickler(io.BytesIO(published)).load()
    except Exception as e:
        raise RendezvousRefused(
            "rendezvous_not_allowed",
            f"the trainer published something other than an NCCL unique id: {e}",
        ) from e
    match value:
        case (cls, (dict() as attributes, bytes() as raw)) if (
            cls is _UniqueIdClass and not attributes and len(raw) == _UNIQUE_ID_BYTES
        ):
            return raw
    raise RendezvousRefused(
        "rendezvous_not_allowed",
        f"the trainer published something other than an NCCL unique id ({type(value).__name__})",
    )


def _join_nccl(init_info: Any, parallel: Any) -> tuple[TCPStore, Any]:
    """Join the trainer's NCCL group as vLLM's worker does, minus the unpickling."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.utils.nccl import unpinned_nccl_env

    rank = (
        init_info.rank_offset + parallel.data_parallel_index * parallel.world_size + parallel.rank
    )
    store = TCPStore(
        host_name=init_info.master_address,
        port=init_info.master_port,
        world_size=init_info.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        use_libuv=False,
    )
    unique_id = nccl_unique_id(store.get(UNIQUE_ID_KEY))
    with unpinned_nccl_env():
        group = PyNcclCommunicator.from_unique_id_bytes(
            unique_id,
            rank=rank,
            world_size=init_info.world_size,
            device=torch.accelerator.current_device_index(),
        )
    return store, group


class WeightrollNCCLEngine(VerifiedBackendMixin, NCCLWeightTransferEngine):
    """vLLM's dense NCCL engine (packed or not) feeding the verified session."""

    _weightroll_store: TCPStore | None = None

    def init_transfer_engine(self, init_info: Any) -> None:
        self.check_rendezvous(asdict(init_info))  # before the store is contacted
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        self._weightroll_store, self.model_update_group = _join_nccl(
            init_info, self.parallel_config
        )

    def shutdown(self) -> None:
        super().shutdown()
        self._weightroll_store = None

    def receive_weights(self, update_info: Any) -> None:
        self.receive_through_feeder(super().receive_weights, update_info)


class WeightrollIPCEngine(VerifiedBackendMixin, IPCWeightTransferEngine):
    """vLLM's CUDA IPC engine feeding the verified session."""

    repeats_metadata = False

    def init_transfer_engine(self, init_info: Any) -> None:
        self.check_rendezvous(asdict(init_info))  # no peer, but the trainer networks gate it
        super().init_transfer_engine(init_info)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        check_update_info(update_dict)  # before vLLM's dataclass unpickles the handles
        return super().parse_update_info(update_dict)

    def receive_weights(self, update_info: Any) -> None:
        self.receive_through_feeder(super().receive_weights, update_info)
