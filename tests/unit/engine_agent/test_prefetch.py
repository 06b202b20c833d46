"""Prefetch before the drain (issue 30), the pure parts: the rank's state while it stages, the
request field, the memory bound and the agent's wait for every rank."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from engine_agent.errors import InvalidRequest, UpdateConflict, WrongState
from engine_agent.protocol import (
    EngineState,
    PrefetchArgs,
    PrefetchMode,
    RankId,
    RankReport,
    UpdatePhase,
    UpdateRequest,
)
from engine_agent.reload import session
from engine_agent.reload.prefetch import available_memory, memory_problem
from engine_agent.reload.registry import _ranks_on_host
from engine_agent.reload.session import WeightState
from engine_agent.sidecar.swap import prefetch_waiting
from tests.unit.engine_agent.test_reload_session import spec

CLEAN = session.initial("v1")
POISONED = WeightState(EngineState.POISONED, "v1", poison_reason="half-failed")
COMMITTED = WeightState(EngineState.CLEAN, "v1", committed_by="u0")


# -- the rank's state machine -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("start", "mode", "kw", "error"),
    [
        (CLEAN, "full", {}, None),
        (CLEAN, "partial", {}, None),
        (CLEAN, "partial", {"base_version": "v0"}, WrongState),  # refused before any read
        (COMMITTED, "partial", {"base_update_id": "u0"}, None),
        (COMMITTED, "partial", {}, WrongState),  # not the commit it builds on
        (CLEAN, "sparse", {}, InvalidRequest),  # sparse stays on today's path
        (POISONED, "full", {}, None),  # a full update may recover a poisoned rank
        (POISONED, "partial", {}, WrongState),
    ],
)
def test_prefetch_leaves_what_the_rank_serves_unchanged(
    start: WeightState, mode: str, kw: dict[str, object], error: type | None
) -> None:
    if error is not None:
        with pytest.raises(error):
            session.prefetch(start, spec(mode, **kw))
        return
    staged = session.prefetch(start, spec(mode, **kw))
    assert staged.prefetched == "u1"
    # the guard and readiness read these: still exactly what was served before
    assert (staged.state, staged.version, staged.serving_safe, staged.committed_by) == (
        start.state,
        start.version,
        start.serving_safe,
        start.committed_by,
    )
    assert not staged.in_session


def test_a_repeated_prefetch_is_acknowledged_and_another_is_a_conflict() -> None:
    staged = session.prefetch(CLEAN, spec())
    assert session.prefetch(staged, spec()) == staged
    with pytest.raises(UpdateConflict):
        session.prefetch(staged, spec(update_id="u2"))
    with pytest.raises(UpdateConflict):
        session.begin(staged, spec(update_id="u2"))


def test_no_prefetch_inside_a_session() -> None:
    with pytest.raises(UpdateConflict):
        session.prefetch(session.begin(CLEAN, spec()), spec())


def test_the_prefetched_update_opens_its_session_and_then_writes() -> None:
    staged = session.prefetch(CLEAN, spec())
    opened = session.begin(staged, spec())
    assert opened.state is EngineState.OPEN and opened.prefetched == "u1"
    applied = session.mark_written(session.drop_prefetch(opened))
    assert applied.state is EngineState.DIRTY and applied.prefetched is None
    committed = session.commit(applied)
    assert (committed.state, committed.version, committed.prefetched) == (
        EngineState.CLEAN,
        "v2",
        None,
    )


@pytest.mark.parametrize(
    ("close", "state"),
    [
        # before the drain: nothing written, the staging is only freed
        (lambda ws: session.drop_prefetch(ws), EngineState.CLEAN),
        (lambda ws: session.fail(ws, "x"), EngineState.CLEAN),  # fail outside a session: as is
        # the guard found the live bytes changed: poisoned, and the staging is forgotten
        (lambda ws: session.poison(ws, "still true violated"), EngineState.POISONED),
    ],
)
def test_closing_a_prefetch_before_its_session(close: object, state: EngineState) -> None:
    staged = session.prefetch(CLEAN, spec())
    closed = close(staged)  # type: ignore[operator]
    assert closed.state is state and closed.version == "v1"
    if state is EngineState.CLEAN:
        assert session.drop_prefetch(closed).prefetched is None
    else:
        assert closed.prefetched is None


def test_a_failure_after_the_drain_is_today_s_failure() -> None:
    opened = session.begin(session.prefetch(CLEAN, spec()), spec())
    assert session.fail(opened, "apply failed").state is EngineState.CLEAN  # nothing written
    dirty = session.mark_written(session.drop_prefetch(opened))
    assert session.fail(dirty, "apply failed").state is EngineState.POISONED


# -- the request field --------------------------------------------------------------------------


def request(**kw: object) -> dict[str, object]:
    return {"id": "u1", "version": "v2", "source": {"uri": "/models/b"}} | kw


def test_prefetch_defaults_to_today_s_path() -> None:
    parsed = UpdateRequest.model_validate(request())
    assert parsed.prefetch.mode is PrefetchMode.NONE and parsed.prefetch.max_bytes is None


def test_prefetch_field_in_camel_case() -> None:
    parsed = UpdateRequest.model_validate(request(prefetch={"mode": "Host", "maxBytes": 1 << 30}))
    assert parsed.prefetch.mode is PrefetchMode.HOST and parsed.prefetch.max_bytes == 1 << 30
    assert parsed.to_wire()["prefetch"] == {
        "mode": "Host",
        "maxBytes": 1 << 30,
        "awaitSwap": False,
        "swapDeadlineSeconds": 600,
    }


@pytest.mark.parametrize(
    ("extra", "text"),
    [
        ({"prefetch": {"mode": "Disk"}}, "mode"),
        ({"prefetch": {"mode": "Host", "maxBytes": 0}}, "maxBytes"),
        ({"prefetch": {"mode": "Host", "max": 1}}, "max"),
        ({"prefetch": {"awaitSwap": True}}, "awaitSwap needs prefetch.mode 'Host'"),
        ({"prefetch": {"mode": "Host", "swapDeadlineSeconds": 0}}, "swapDeadlineSeconds"),
        (
            {"prefetch": {"mode": "Host"}, "mode": "sparse", "baseVersion": "v1"},
            "not supported for sparse",
        ),
    ],
)
def test_prefetch_field_refusals(extra: dict[str, object], text: str) -> None:
    with pytest.raises(ValidationError, match=text):
        UpdateRequest.model_validate(request(**extra))


def test_prefetch_args_round_trip() -> None:
    args = PrefetchArgs.model_validate(
        {"spec": spec().to_wire(), "source": {"path": "/m"}, "maxBytes": 5}
    )
    assert PrefetchArgs.model_validate_json(args.model_dump_json(by_alias=True)) == args


def test_prefetch_phases_come_before_the_drain_and_are_not_terminal() -> None:
    phases = list(UpdatePhase)
    assert phases.index(UpdatePhase.PREFETCHING) < phases.index(UpdatePhase.PREFETCHED)
    assert phases.index(UpdatePhase.PREFETCHED) < phases.index(UpdatePhase.DRAINING)
    assert not UpdatePhase.PREFETCHING.terminal and not UpdatePhase.PREFETCHED.terminal


# -- the memory bound ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "limit", "available", "ranks", "words"),
    [
        (100, None, 1000, 1, None),
        (100, 100, 1000, 1, None),
        (101, 100, 1000, 1, "above its limit prefetch.maxBytes=100"),
        (100, None, 99, 1, "above the host's available memory (99 bytes)"),
        (100, 1000, 99, 1, "above the host's available memory"),
        (100, None, None, 1, "available memory is unknown"),
        # TP ranks on one host each stage the whole checkpoint at once: the host holds them all
        (100, None, 200, 2, None),
        (100, None, 199, 2, "(2 ranks on this host, 200 bytes), above the host's available"),
        (100, 100, 799, 8, "(8 ranks on this host, 800 bytes)"),
    ],
)
def test_memory_problem(
    stage: int, limit: int | None, available: int | None, ranks: int, words: str | None
) -> None:
    problem = memory_problem(stage, limit, available, ranks)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem and str(stage) in problem
        assert "\n" not in problem


@pytest.mark.parametrize(
    ("config", "ranks"),
    [
        ({"local_world_size": 4, "world_size": 8}, 4),  # two nodes of four
        ({"world_size": 2}, 2),  # a vLLM without local_world_size: never fewer
        ({}, 1),
    ],
)
def test_ranks_on_host_come_from_vllms_parallel_config(config: dict[str, int], ranks: int) -> None:
    assert _ranks_on_host(SimpleNamespace(**config)) == ranks


def test_available_memory_reads_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000 kB\nMemAvailable:    2048 kB\n")
    assert available_memory(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:       16000 kB\n")
    assert available_memory(meminfo) is None
    assert available_memory(tmp_path / "absent") is None


# -- the agent's wait ------------------------------------------------------------------------------


def report(tp: int, prefetch: str) -> RankReport:
    return RankReport(
        rank=RankId(dp=0, pp=0, tp=tp),
        call="prefetched",
        ok=True,
        state=EngineState.CLEAN,
        version="v1",
        update_id="u1",
        prefetch=prefetch,
    )


def test_prefetch_waiting_names_every_rank_not_ready() -> None:
    assert prefetch_waiting([report(0, "ready"), report(1, "ready")]) == []
    waiting = [report(2, "reading"), report(0, "ready"), report(1, "")]
    assert prefetch_waiting(waiting) == ["dp0:pp0:tp1:ep0", "dp0:pp0:tp2:ep0"]


def test_the_preparation_takes_what_was_read_once_and_counts_what_waits() -> None:
    """A poll takes the tensors read so far (issue 30: prepared while the read goes on); each
    is handed out once, and what waits is counted in bytes."""
    import threading
    import time
    from collections.abc import Callable

    import torch

    from engine_agent.reload.prefetch import Prefetch

    go = threading.Event()
    tensors = [(f"t{i}", torch.full((4,), float(i))) for i in range(3)]

    class Checkpoint:
        def tensors(self) -> object:
            yield tensors[0]
            go.wait(5)
            yield from tensors[1:]

        def complete(self) -> None:
            pass

    def until(condition: Callable[[], bool]) -> None:
        for _ in range(10_000):  # a bound, not a timing: the read thread is a few steps long
            if condition():
                return
            time.sleep(0.001)
        raise AssertionError("the read thread never got there")

    staging = Prefetch(spec(), Checkpoint(), stage_bytes=48)
    staging.start()
    until(lambda: staging.pending_bytes >= 16)
    assert [n for n, _ in staging.take()] == ["t0"] and staging.status == "reading"
    assert staging.pending_bytes == 0
    go.set()
    until(lambda: staging.status != "reading")
    assert staging.status == "ready" and staging.pending_bytes == 32
    assert [n for n, _ in staging.take(max_bytes=16)] == ["t1"]  # bounded per poll
    assert staging.pending_bytes == 16
    assert [n for n, _ in staging.take()] == ["t2"]
    assert staging.take() == [] and staging.pending_bytes == 0
