"""Tensor parallel = 2 on CPU: per-rank coverage, and one failing rank poisons the engine.

Issue 2 acceptance 9. The two workers are separate processes bound to one core each
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``); a failpoint file (engine_agent/reload/failpoints.py) makes
exactly one rank fail its load, which no outside input can do to a real engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.engines import TWO_RANK_BINDING, Engine, environ, start_engine

pytestmark = pytest.mark.tp2


@pytest.fixture(scope="module")
def tp2(
    checkpoints: Callable[[str, int], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    failpoints = tmp_path_factory.mktemp("tp2") / "failpoints"
    with environ({**TWO_RANK_BINDING, "WEIGHTROLL_FAILPOINTS_FILE": str(failpoints)}):
        engine = start_engine(checkpoints("llama", 0), tensor_parallel_size=2)
        try:
            yield {
                "engine": engine,
                "a": checkpoints("llama", 0),
                "b": checkpoints("llama", 1),
                "failpoints": failpoints,
                "boot": engine.outputs(),
            }
        finally:
            engine.close()


def test_each_rank_reports_its_own_coverage_and_one_failing_rank_poisons(
    tp2: dict[str, Any],
) -> None:
    engine: Engine = tp2["engine"]
    reports = engine.update("tp2-b", "b", tp2["b"])
    assert [r["rank"]["tp"] for r in reports] == [0, 1]
    assert all(r["ok"] and r["state"] == "clean" and r["version"] == "b" for r in reports), reports
    # Both ranks expect the same shard keys (each for its own slice) ...
    assert reports[0]["coverageHash"] == reports[1]["coverageHash"]
    assert reports[0]["required"] == reports[1]["required"] == 21
    # ... and both read the whole checkpoint: the digest covers the bytes handed to the
    # loaders (docs/engine.md, "What a rank's digest covers"), not each rank's slice.
    assert reports[0]["digest"] == reports[1]["digest"] != ""
    assert engine.outputs().tokens != tp2["boot"].tokens

    tp2["failpoints"].write_text("load@tp1")
    begin = engine.rpc("weightroll_begin", {"updateId": "tp2-fail", "version": "a"})
    assert all(r["ok"] for r in begin)
    loaded = engine.rpc("weightroll_load", {"path": str(tp2["a"])})
    by_rank = {r["rank"]["tp"]: r for r in loaded}
    assert by_rank[0]["ok"] and by_rank[0]["state"] == "dirty"
    assert not by_rank[1]["ok"] and by_rank[1]["error"]["code"] == "source_unavailable"
    # Rank 1 failed before writing, so on its own it is still clean ...
    assert by_rank[1]["state"] == "clean"
    # ... but the replica is mixed: the coordinator (the sidecar) fences every rank.
    engine.rpc("weightroll_abort", {"poison": True, "reason": "rank tp1 failed its load"})
    states = engine.state()
    assert [s["state"] for s in states] == ["poisoned", "poisoned"]
    assert not any(s["servingSafe"] for s in states)

    tp2["failpoints"].write_text("")
    recovered = engine.update("tp2-recover", "a", tp2["a"])
    assert all(r["ok"] and r["state"] == "clean" for r in recovered), recovered
    assert engine.outputs() == tp2["boot"]


def test_a_prefetched_update_on_two_ranks_and_one_rank_failing_its_read(
    tp2: dict[str, Any],
) -> None:
    """Issue 30 on TP=2: each rank prefetches on its own thread; a read that fails on one rank
    leaves both clean at their version (nothing was written) once the staging is freed."""
    engine: Engine = tp2["engine"]
    assert engine.state()[0]["version"] == "a"
    reports = engine.prefetched_update("tp2-pf-b", "b", tp2["b"])
    assert all(r["ok"] and r["state"] == "clean" and r["version"] == "b" for r in reports), reports
    assert reports[0]["digest"] == reports[1]["digest"] != ""
    assert engine.outputs().tokens != tp2["boot"].tokens

    tp2["failpoints"].write_text("prefetch.read@tp1")
    failed = engine.prefetched_update("tp2-pf-fail", "a", tp2["a"])
    tp2["failpoints"].write_text("")
    by_rank = {r["rank"]["tp"]: r for r in failed}
    assert not by_rank[1]["ok"] and by_rank[1]["error"]["code"] == "source_unavailable"
    engine.rpc("weightroll_abort")  # what the agent sends: frees rank 0's staging, no poison
    states = engine.state()
    assert [(s["state"], s["version"]) for s in states] == [("clean", "b"), ("clean", "b")]

    recovered = engine.prefetched_update("tp2-pf-a", "a", tp2["a"])
    assert all(r["ok"] and r["state"] == "clean" for r in recovered), recovered
    assert engine.outputs() == tp2["boot"]
