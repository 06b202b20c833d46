"""Unit tests of the weight-transfer backends without an engine: registration, info classes,
the lifecycle wiring (poison on a failed update, 0.33's empty-list update) and the Gloo
transport end to end between two in-process peers.

The verified session itself (coverage, duplicates, staging, derived state) is the reload
engine's and is exercised on real vLLM servers in tests/server/test_trainer_*.py; here a
recording stand-in takes its place so the backend's wiring can be checked in isolation.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import os
import pickle
import socket
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the backends subclass vLLM's engines")

import torch
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.ipc_engine import (
    IPCTrainerWeightTransferEngine,
    IPCWeightTransferEngine,
)
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerWeightTransferEngine,
    NCCLWeightTransferEngine,
)

import engine_agent.transfer as transfer
from engine_agent.trainer import AgentSyncClient, PushRejected, push_fleet
from engine_agent.transfer.backend import Feeder, same_metadata
from engine_agent.transfer.cuda import WeightrollIPCEngine, WeightrollNCCLEngine, nccl_unique_id
from engine_agent.transfer.gloo import (
    GlooTrainerInitInfo,
    GlooTrainerWeightTransferEngine,
    GlooWeightTransferEngine,
    free_port,
)
from engine_agent.transfer.rendezvous import RendezvousRefused
from engine_agent.transfer.verified import TransferRefused, describe

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def trainer_networks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' allow-list (the vLLM container's ``WEIGHTROLL_TRAINER_NETWORKS``): the
    in-process Gloo peers rendezvous on loopback."""
    monkeypatch.setenv("WEIGHTROLL_TRAINER_NETWORKS", "127.0.0.1/32")


class Recorder:
    """Stands in for :class:`VerifiedReceiver`: records what the backend asks of the session."""

    def __init__(self, refuse_after: int | None = None) -> None:
        self.calls: list[str] = []
        self.fed: list[tuple[str, torch.Tensor]] = []
        self.refuse_after = refuse_after

    def start(self) -> None:
        self.calls.append("start")

    def finish(self) -> None:
        self.calls.append("finish")

    def feed(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        self.calls.append(f"feed:{len(batch)}")
        if self.refuse_after is not None and len(self.fed) + len(batch) > self.refuse_after:
            raise TransferRefused("rank dp0:pp0:tp0:ep0: duplicate_shard: x[q]")
        self.fed.extend(batch)

    def poison(self, reason: str) -> None:
        self.calls.append(f"poison:{reason}")


def _config() -> Any:
    parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    return SimpleNamespace(parallel_config=parallel, model_config=SimpleNamespace())


def test_backends_are_registered_once_under_their_public_names() -> None:
    transfer.register_backends()
    transfer.register_backends()  # plugins load more than once: idempotent
    created = {
        name: WeightTransferEngineFactory._registry[name]()
        for name in ("weightroll_nccl", "weightroll_ipc", "weightroll_gloo")
    }
    assert created == {
        "weightroll_nccl": WeightrollNCCLEngine,
        "weightroll_ipc": WeightrollIPCEngine,
        "weightroll_gloo": GlooWeightTransferEngine,
    }
    assert WeightTransferTrainerFactory._registry["weightroll_gloo"]() is (
        GlooTrainerWeightTransferEngine
    )
    assert GlooTrainerInitInfo.backend == "weightroll_gloo"


def test_cuda_backends_keep_vllms_info_classes_so_stock_trainers_talk_to_them() -> None:
    assert issubclass(WeightrollNCCLEngine, NCCLWeightTransferEngine)
    assert issubclass(WeightrollIPCEngine, IPCWeightTransferEngine)
    assert WeightrollNCCLEngine.init_info_cls is NCCLWeightTransferEngine.init_info_cls
    assert WeightrollNCCLEngine.update_info_cls is NCCLWeightTransferEngine.update_info_cls
    assert WeightrollIPCEngine.init_info_cls is IPCWeightTransferEngine.init_info_cls
    assert WeightrollIPCEngine.update_info_cls is IPCWeightTransferEngine.update_info_cls
    # The stock trainer side builds the payloads these classes parse.
    assert NCCLTrainerWeightTransferEngine.init_info_cls.backend == "nccl"
    assert IPCTrainerWeightTransferEngine.init_info_cls.backend == "ipc"
    for cls in (WeightrollNCCLEngine, WeightrollIPCEngine, GlooWeightTransferEngine):
        assert cls.supports_draft_weight_update is False


def test_the_plugin_entry_point_is_the_registration_function() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["vllm.general_plugins"]["weightroll"]
    module, _, name = target.partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is transfer.register_backends


def test_an_empty_nccl_update_repeats_the_previous_metadata_never_means_no_weights() -> None:
    first = {"names": ["a", "b"], "dtype_names": ["bfloat16"] * 2, "shapes": [[2], [3]]}
    empty = {"names": [], "dtype_names": [], "shapes": []}
    assert same_metadata(first, None) is first
    assert same_metadata(empty, first) == first
    with pytest.raises(ValueError, match="repeats the previous"):
        same_metadata(empty, None)


def test_a_failed_update_poisons_the_rank_before_vllm_drops_the_session() -> None:
    engine = WeightrollNCCLEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    recorder = Recorder()
    engine._weightroll_receiver = recorder  # type: ignore[assignment]
    engine.start_weight_update()
    info = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    with pytest.raises(RuntimeError, match="not initialized"):
        engine.update_weights(info)  # no NCCL group: the receive raises
    assert recorder.calls[0] == "start"
    assert recorder.calls[1].startswith("poison:update_weights failed: RuntimeError")


class Payload:
    """A pickle that runs ``touch <marker>`` when unpickled: what a hostile peer publishes."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A listening socket: whoever connects to it shows up in ``accept``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sock.setblocking(False)
        yield sock


def _nobody_connected(sock: socket.socket) -> bool:
    with contextlib.suppress(BlockingIOError):
        sock.accept()[0].close()
        return False
    return True


@pytest.mark.parametrize(
    ("networks", "code"),
    [
        (None, "trainer_push_disabled"),  # the vLLM container does not set the variable
        ("", "trainer_push_disabled"),
        ("10.0.0.0/8", "rendezvous_not_allowed"),
    ],
)
def test_worker_backends_refuse_a_rendezvous_outside_their_networks_before_connecting(
    monkeypatch: pytest.MonkeyPatch, listener: socket.socket, networks: str | None, code: str
) -> None:
    """Defence in depth (issue 28, item 2): a caller that reaches vLLM's loopback routes
    directly still cannot point a worker at a host outside ``WEIGHTROLL_TRAINER_NETWORKS``."""
    if networks is None:
        monkeypatch.delenv("WEIGHTROLL_TRAINER_NETWORKS")
    else:
        monkeypatch.setenv("WEIGHTROLL_TRAINER_NETWORKS", networks)
    port = listener.getsockname()[1]
    rendezvous = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    gloo = GlooWeightTransferEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    nccl = WeightrollNCCLEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    ipc = WeightrollIPCEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    refusing: list[tuple[Any, dict[str, Any]]] = [
        (gloo, {**rendezvous, "timeout_s": 2}),
        (nccl, {**rendezvous, "rank_offset": 1}),
    ]
    if networks:
        ipc.init_transfer_engine(ipc.parse_init_info({}))  # no peer to check
    else:
        refusing.append((ipc, {}))  # no peer, but no trainer network: every push refused
    for engine, info in refusing:
        with pytest.raises(RendezvousRefused) as refused:
            engine.init_transfer_engine(engine.parse_init_info(info))
        assert refused.value.code == code, (type(engine).__name__, refused.value)
        assert "WEIGHTROLL_TRAINER_NETWORKS" in str(refused.value)
    assert _nobody_connected(listener)


def test_the_nccl_worker_never_unpickles_what_the_trainer_publishes(tmp_path: Path) -> None:
    """vLLM's stock NCCL worker joins through ``StatelessProcessGroup.broadcast_obj``, which
    unpickles whatever the store at ``master_address`` holds; weightroll's reads the unique id
    itself and admits nothing but a ``ncclUniqueId``'s bytes."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]
    from vllm.distributed.device_communicators.pynccl_wrapper import ncclUniqueId

    marker = tmp_path / "ran"
    store = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    store.set("broadcast_from/0/0", pickle.dumps(Payload(marker)))
    engine = WeightrollNCCLEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    info = engine.parse_init_info(
        {
            "master_address": "127.0.0.1",
            "master_port": store.port,
            "rank_offset": 1,
            "world_size": 2,
        }
    )
    with pytest.raises(RendezvousRefused, match=r"may not name posix\.system"):
        engine.init_transfer_engine(info)
    assert not marker.exists()
    # What a stock NCCLTrainerWeightTransferEngine publishes still decodes, byte for byte.
    unique_id = ncclUniqueId()
    for i in range(128):
        unique_id.internal[i] = (i * 37) % 128
    assert nccl_unique_id(pickle.dumps(unique_id)) == bytes(unique_id.internal)
    for other in (pickle.dumps(b"x" * 128), pickle.dumps({"internal": 1}), b"not a pickle"):
        with pytest.raises(RendezvousRefused):
            nccl_unique_id(other)
    # NCCL's pre-shared unique id embeds a bootstrap address nobody can check: refused.
    uid = base64.b64encode(bytes(128)).decode()
    with pytest.raises(RendezvousRefused, match="nccl_unique_id_b64"):
        engine.init_transfer_engine(
            engine.parse_init_info({"nccl_unique_id_b64": uid, "rank_offset": 1, "world_size": 2})
        )


def test_ipc_refuses_pickled_handles_even_where_vllm_would_unpickle_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    marker = tmp_path / "ran"
    pickled = base64.b64encode(pickle.dumps(Payload(marker))).decode()
    update = {"names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[2]]}
    engine = WeightrollIPCEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    recorder = Recorder()
    engine._weightroll_receiver = recorder  # type: ignore[assignment]
    with pytest.raises(RendezvousRefused, match="ipc_handles_pickled"):
        engine.parse_update_info({**update, "ipc_handles_pickled": pickled})
    with pytest.raises(RendezvousRefused, match="ipc_handles_pickled"):
        engine.update_weights({**update, "ipc_handles_pickled": pickled})
    assert not marker.exists()
    assert recorder.calls[-1].startswith("poison:update_weights failed: RendezvousRefused")


def test_the_feeder_keeps_draining_after_a_refusal_and_raises_at_the_end() -> None:
    recorder = Recorder(refuse_after=1)
    feeder = Feeder(recorder)  # type: ignore[arg-type]
    tensor = torch.zeros(2)
    feeder.load_weights([("a", tensor)])
    feeder.load_weights(iter([("b", tensor), ("c", tensor)]))
    feeder.load_weights(iter([("d", tensor)]))  # swallowed: the stream continues
    assert recorder.calls == ["feed:1", "feed:2"]
    with pytest.raises(TransferRefused, match="duplicate_shard"):
        feeder.raise_error()


class LocalClient:
    """A ``VLLMWeightSyncClient`` that calls a worker engine in this process (two Gloo peers)."""

    def __init__(self, worker: GlooWeightTransferEngine) -> None:
        self.worker = worker
        self.versions: list[str | None] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.worker.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.worker.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.worker.finish_weight_update()
        self.versions.append(weight_version)


def _pair(recorder: Recorder, batch_bytes: int) -> tuple[Any, LocalClient, torch.nn.Module]:
    worker = GlooWeightTransferEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    worker._weightroll_receiver = recorder  # type: ignore[assignment]
    client = LocalClient(worker)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        timeout_s=30,
        batch_bytes=batch_bytes,
        rank=0,
    )
    trainer = WeightTransferTrainerFactory.trainer_init(
        info, client=client, source=ModuleSource(model)
    )
    return trainer, client, model


def test_gloo_moves_every_tensor_bit_for_bit_in_metadata_order() -> None:
    recorder = Recorder()
    trainer, client, model = _pair(recorder, batch_bytes=64)
    trainer.send_weights(weight_version="v7")  # type: ignore[call-arg]
    sent = dict(model.named_parameters())
    assert [name for name, _ in recorder.fed] == list(sent)
    for name, tensor in recorder.fed:
        assert torch.equal(tensor, sent[name].detach()), name
    assert recorder.calls[0] == "start" and recorder.calls[-1] == "finish"
    assert sum(1 for c in recorder.calls if c.startswith("feed")) > 1  # batched by bytes
    assert client.versions == ["v7"]
    # vLLM 0.33: an empty-list update re-sends the previous metadata.
    recorder.fed.clear()
    worker = client.worker
    worker.start_weight_update()

    def broadcast() -> None:
        from engine_agent.transfer.gloo import _broadcast

        for tensor in sent.values():
            _broadcast(trainer._group, tensor.detach().contiguous())

    sender = threading.Thread(target=broadcast)
    sender.start()
    worker.update_weights({"names": [], "dtype_names": [], "shapes": []})
    sender.join()
    assert [name for name, _ in recorder.fed] == list(sent)


def test_gloo_refusal_mid_stream_keeps_the_trainer_unblocked_and_poisons() -> None:
    recorder = Recorder(refuse_after=1)
    trainer, _, _ = _pair(recorder, batch_bytes=1)
    with pytest.raises(TransferRefused, match="duplicate_shard"):
        trainer.send_weights()
    assert any(
        call.startswith("poison:update_weights failed: TransferRefused") for call in recorder.calls
    )
    assert "finish" not in recorder.calls


def test_describe_names_the_missing_and_duplicated_shards() -> None:
    report = {
        "rank": {"dp": 0, "pp": 0, "tp": 1},
        "call": "finish",
        "ok": False,
        "state": "poisoned",
        "version": "v1",
        "error": {"code": "coverage_incomplete", "message": "2 required shard(s) never arrived"},
        "missing": ["l0.qkv_proj.weight[k]", "l0.qkv_proj.weight[v]"],
        "missingCount": 2,
        "duplicates": ["l0.qkv_proj.weight[q]"],
    }
    assert describe(report) == (
        "rank dp0:pp0:tp1:ep0: coverage_incomplete: 2 required shard(s) never arrived; "
        "missing l0.qkv_proj.weight[k], l0.qkv_proj.weight[v]; duplicate l0.qkv_proj.weight[q]"
    )


class Refusing(LocalClient):
    """An agent that refuses the rendezvous (its trainer networks) as soon as it is posted."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        error = {"code": "rendezvous_not_allowed", "message": "outside the trainer networks"}
        raise PushRejected("/init_weight_transfer_engine", 403, error)


def test_a_refused_rendezvous_reaches_the_trainer_at_once_not_after_the_group_timeout() -> None:
    worker = GlooWeightTransferEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
    model = torch.nn.Linear(4, 2)
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=2, timeout_s=60, rank=0
    )
    started = time.monotonic()
    with pytest.raises(PushRejected, match="rendezvous_not_allowed"):
        WeightTransferTrainerFactory.trainer_init(
            info, client=Refusing(worker), source=ModuleSource(model)
        )
    assert time.monotonic() - started < 30


class Replica(LocalClient):
    """A local Gloo worker that answers like an agent: ``last_finish`` on commit, or the
    agent's refusal (``PushRejected`` with its ``ErrorBody``) when its rank refuses."""

    def __init__(self, url: str, refuse: bool) -> None:
        worker = GlooWeightTransferEngine(SimpleNamespace(), _config(), torch.device("cpu"), None)
        self.recorder = Recorder()
        worker._weightroll_receiver = self.recorder  # type: ignore[assignment]
        super().__init__(worker)
        self.base_url = url
        self.refuse = refuse
        self.last_finish: dict[str, Any] | None = None

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version)
        if self.refuse:
            error = {"code": "coverage_incomplete", "message": "1 required shard(s) never arrived"}
            raise PushRejected("/finish_weight_update", 422, error)
        self.last_finish = {"weight_version": weight_version, "ranks": [{"ok": True}]}


def test_push_fleet_returns_one_result_per_replica_in_order() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    replicas = [
        Replica("http://r0", False),
        Replica("http://r1", True),
        Replica("http://r2", False),
    ]
    nowhere = AgentSyncClient(f"http://127.0.0.1:{free_port()}", token="t", timeout=5)

    def init_info(_: Any) -> GlooTrainerInitInfo:
        if _ is nowhere:
            nowhere.weight_info()  # what gloo_init_info asks first: unreachable
        return GlooTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=2, timeout_s=30, rank=0
        )

    results = push_fleet(
        [*replicas, nowhere],  # type: ignore[list-item]
        ModuleSource(model),
        weight_version="v2",
        init_info=init_info,
    )
    assert [(r.url, r.outcome) for r in results] == [
        ("http://r0", "committed"),
        ("http://r1", "failed"),
        ("http://r2", "committed"),
        (nowhere.base_url, "unreachable"),
    ]
    assert results[0].version == "v2" and results[0].ranks == ({"ok": True},)
    assert results[1].code == "coverage_incomplete" and "never arrived" in results[1].reason
    for replica in (replicas[0], replicas[2]):
        assert [name for name, _ in replica.recorder.fed] == ["weight", "bias"]


class AgentAfterRestart:
    """The agent of a replica whose vLLM restarted since the trainer's rendezvous: it opens the
    push on the new ranks, then refuses ``update_weights`` (the new workers never joined the
    trainer's group) — answering, as a real agent may, after the trainer's next send failed."""

    def __init__(self, transport_broke: threading.Event) -> None:
        self.transport_broke = transport_broke

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise AssertionError("the rendezvous happened before the restart")

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        assert self.transport_broke.wait(60), "the trainer never noticed the workers left"
        error = {
            "code": "engine_error",
            "message": "/update_weights: weightroll_gloo is not initialised on rank tp0",
        }
        raise PushRejected("/update_weights", 422, error)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise AssertionError("finish after a refused update")


def test_a_vllm_restart_gives_the_trainer_the_agents_reason_not_gloos_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 26, item 9: Gloo's "Connection closed by peer" escaped ``send_weights`` instead of
    the agent's refusal, so a trainer could not tell a restarted replica from a network fault."""
    import engine_agent.transfer.gloo as gloo

    trainer, client, _ = _pair(Recorder(), batch_bytes=64)
    broke = threading.Event()
    send = gloo._broadcast

    def observed(group: Any, tensor: torch.Tensor) -> None:  # only observes: lets the agent
        try:  # answer after the transport broke, the order that let Gloo's error escape
            send(group, tensor)
        except RuntimeError:
            broke.set()
            raise

    monkeypatch.setattr(gloo, "_broadcast", observed)
    client.worker.shutdown()  # vLLM restarted: its workers left the trainer's group
    gc.collect()
    trainer.client = AgentAfterRestart(broke)
    with pytest.raises(PushRejected) as refused:
        trainer.send_weights(weight_version="v2")  # type: ignore[call-arg]
    assert refused.value.error["code"] == "engine_error", refused.value
    assert "not initialised" in refused.value.error["message"]
    assert isinstance(refused.value.__cause__, RuntimeError)  # Gloo's error, chained
