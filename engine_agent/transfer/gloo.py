"""``weightroll_gloo``: a CPU weight transport over ``torch.distributed`` Gloo, both sides.

Worker side (:class:`GlooWeightTransferEngine`, registered in ``WeightTransferEngineFactory``)
and trainer side (:class:`GlooTrainerWeightTransferEngine`, registered in
``WeightTransferTrainerFactory``) under the same name, mirroring vLLM's dense NCCL pair:

* rendezvous: the trainer (rank 0) hosts a ``TCPStore`` at ``master_address:master_port``,
  which must lie in the worker's trainer networks (``WEIGHTROLL_TRAINER_NETWORKS``, checked
  before the store is contacted; nothing read from the store is unpickled, Gloo exchanges
  addresses in its own binary format);
  each worker joins as rank ``rank_offset + dp_index * world_size_per_dp + rank``. The group is
  a private ``ProcessGroupGloo`` over a prefixed store, so it never touches the engine's own
  default process group (vLLM's CPU TP uses Gloo too);
* per update: the trainer posts ``update_weights`` with ``names/dtype_names/shapes`` (the NCCL
  update info, including 0.33's empty-list "same as last time") and broadcasts each tensor from
  rank 0 in that order; the worker receives into fresh CPU tensors and feeds them to the
  verified session in batches of at most ``batch_bytes``.

Order contract: metadata and iteration must agree (checked on the trainer per tensor, as vLLM's
NCCL trainer does). A refused batch does not stop the worker from receiving the rest of the
stream, so the trainer never hangs on a peer that gave up; the error is raised at the end.
When the workers go away instead (vLLM restarted), Gloo's "Connection closed by peer" is not
what the trainer sees: it gets the agent's answer to the pending ``update_weights`` (with
:class:`~engine_agent.trainer.AgentSyncClient`, ``PushRejected`` naming the agent's reason).

Limitations: tensors travel over TCP (one copy per worker rank, no multicast); for CPU fleets
and tests, not for GPU clusters (use ``weightroll_nccl`` there).
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from engine_agent.transfer.backend import VerifiedBackendMixin

__all__ = [
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "GlooWeightTransferInitInfo",
    "GlooWeightTransferUpdateInfo",
    "free_port",
]

logger = logging.getLogger(__name__)

#: Store prefix of the transfer group (keeps its keys apart from anything else on the store).
STORE_PREFIX = "weightroll_gloo"
#: Default bound of the rendezvous and of each collective.
DEFAULT_TIMEOUT_S = 300.0
#: Default upper bound of one batch handed to the verified session.
DEFAULT_BATCH_BYTES = 256 * 1024 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (for the trainer's TCPStore)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _group(
    address: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[TCPStore, dist.ProcessGroupGloo]:
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(
        address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    group = dist.ProcessGroupGloo(PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)
    return store, group


def _broadcast(group: dist.ProcessGroupGloo, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()  # type: ignore[attr-defined]


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info (the body of ``/init_weight_transfer_engine``'s ``init_info``)."""

    master_address: str
    master_port: int
    #: Rank of the first worker in the transfer group (the trainer is rank 0).
    rank_offset: int = 1
    #: Trainer plus every worker rank.
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    batch_bytes: int = DEFAULT_BATCH_BYTES


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-update metadata, the same fields as vLLM's NCCL update info."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have the same length, got "
                f"{len(self.names)}, {len(self.dtype_names)} and {len(self.shapes)}"
            )
        for dtype_name in self.dtype_names:
            if not isinstance(getattr(torch, dtype_name, None), torch.dtype):
                raise ValueError(f"unknown dtype name {dtype_name!r}")


class GlooWeightTransferEngine(
    VerifiedBackendMixin,
    WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo],
):
    """Worker side of ``weightroll_gloo``: receive over Gloo, load through the verified session."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self._store: TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        self._batch_bytes = DEFAULT_BATCH_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        self.check_rendezvous(asdict(init_info))  # before the store is contacted
        parallel = self.parallel_config
        rank = (
            init_info.rank_offset
            + parallel.data_parallel_index * parallel.world_size
            + parallel.rank
        )
        self.shutdown()
        self._batch_bytes = init_info.batch_bytes
        self._store, self._group = _group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )
        logger.info(
            "Joined the weightroll_gloo group at %s:%d as rank %d of %d",
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
        )

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        group = self._group
        if group is None:
            raise RuntimeError("weightroll_gloo is not initialised: call init_transfer_engine")
        batch: list[tuple[str, torch.Tensor]] = []
        size = 0
        error: BaseException | None = None
        for name, dtype_name, shape in zip(
            update_info.names, update_info.dtype_names, update_info.shapes, strict=True
        ):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype_name))
            _broadcast(group, tensor)
            if error is not None:
                continue  # keep receiving: the trainer is still broadcasting
            batch.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self._batch_bytes:
                error = self._feed(batch)
                batch, size = [], 0
        if error is None:
            error = self._feed(batch)
        if error is not None:
            raise error

    def _feed(self, batch: list[tuple[str, torch.Tensor]]) -> BaseException | None:
        try:
            self.weightroll.feed(batch)
        except Exception as e:
            return e
        return None

    def shutdown(self) -> None:
        self._group = None
        self._store = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``weightroll_gloo`` (``backend`` is the factory key)."""

    backend: ClassVar[str] = "weightroll_gloo"

    master_address: str
    master_port: int
    #: 1 (the trainer) + every worker rank of the replica.
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    batch_bytes: int = DEFAULT_BATCH_BYTES

    def worker_init_info(self) -> dict[str, Any]:
        """The ``init_info`` the workers receive (rank 0 is the trainer)."""
        return asdict(
            GlooWeightTransferInitInfo(
                master_address=self.master_address,
                master_port=self.master_port,
                rank_offset=1,
                world_size=self.world_size,
                timeout_s=self.timeout_s,
                batch_bytes=self.batch_bytes,
            )
        )


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side of ``weightroll_gloo``: drives start → update ∥ broadcast → finish.

    ``send_weights(weight_version=None)`` names the version the replica commits as (vLLM's
    trainers call ``finish_weight_update()`` without one; then the agent names it).
    """

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self._store: TCPStore | None = None
        self._group: dist.ProcessGroupGloo | None = None
        #: Bound of one collective, and of the wait for the agent's answer when one breaks.
        self._timeout_s = DEFAULT_TIMEOUT_S

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("weightroll_gloo needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        # The workers block in init_weight_transfer_engine until the group forms: post it on a
        # side thread while this process hosts the store and joins as rank 0. A refusal (the
        # agent's trainer networks, say) is raised at once, not after the group timed out.
        posted = _in_daemon_thread(client.init_weight_transfer_engine, init_info.worker_init_info())
        joined = _in_daemon_thread(
            _group,
            init_info.master_address,
            init_info.master_port,
            0,
            init_info.world_size,
            init_info.timeout_s,
        )
        wait([posted, joined], return_when=FIRST_EXCEPTION)
        if posted.done():
            posted.result()  # the inference side's refusal says more
        engine._store, engine._group = joined.result()
        engine._timeout_s = init_info.timeout_s
        posted.result()
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        group = self._group
        if group is None:
            raise RuntimeError("trainer_init() must run before send_weights()")
        update_info = asdict(
            GlooWeightTransferUpdateInfo(
                names=[m.name for m in meta],
                dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
                shapes=[list(m.shape) for m in meta],
            )
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, update_info)
            for _name, tensor in _checked(self.source, meta):
                _raise_if_failed(future)
                try:
                    _broadcast(group, tensor.detach().to("cpu").contiguous())
                except RuntimeError as broken:
                    _raise_answer_over(future, broken, self._timeout_s)
            future.result()
        finally:
            pool.shutdown(wait=False)
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        self._group = None
        self._store = None


def _in_daemon_thread(call: Callable[..., Any], *args: Any) -> Future[Any]:
    """Run ``call`` on a daemon thread: a rank 0 left waiting for workers that were refused
    times out on its own without holding the trainer's exit."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(call(*args))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="weightroll-gloo-init", daemon=True).start()
    return future


def _raise_answer_over(future: Future[Any], broken: RuntimeError, timeout_s: float) -> None:
    """The transport broke mid-broadcast: raise the inference side's answer, else ``broken``.

    Gloo only says "Connection closed by peer" when the workers went away (vLLM restarted, a
    rank crashed); the agent's answer to the pending ``update_weights`` says why, and it is
    what a trainer acts on (``PushRejected`` with the agent's code). It arrives promptly — the
    agent ends the push once vLLM refuses or is unreachable — and is awaited at most as long
    as one collective may take.
    """
    try:
        future.result(timeout=timeout_s)
    except FutureTimeout:
        raise broken from None
    except Exception as answer:
        raise answer from broken
    raise broken


def _raise_if_failed(future: Future[Any]) -> None:
    """Surface an inference-side refusal before the next broadcast would wait for it."""
    if future.done():
        future.result()


def _checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against what the workers were told to expect."""
    sent = 0
    for name, tensor in source:
        if sent >= len(meta):
            raise ValueError(f"WeightSource yielded more than metadata() declared: {name!r}")
        want = meta[sent]
        if (name, tensor.dtype, tuple(tensor.shape)) != (want.name, want.dtype, want.shape):
            raise ValueError(
                f"WeightSource metadata() disagrees with iteration at index {sent}: declared "
                f"{want.name!r} {want.dtype} {want.shape}, got {name!r} {tensor.dtype} "
                f"{tuple(tensor.shape)}"
            )
        sent += 1
        yield name, tensor
    if sent != len(meta):
        raise ValueError(f"WeightSource yielded {sent} tensors, metadata() declared {len(meta)}")
