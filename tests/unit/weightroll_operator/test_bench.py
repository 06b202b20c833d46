"""Smoke test of bench/operator_scale.py at a small size (the full run is the benchmark).

The bench drives the operator's own loop at the shipped default settings (the reaction time
itself is tested in test_loop.py without a clock; the ratio to the ideal rollout time is the
benchmark's goal, not asserted here).
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[3] / "bench" / "operator_scale.py"


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("operator_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_small_fleet_meets_the_goals_at_the_default_settings() -> None:
    report = asyncio.run(_bench().run(30, 1.0, "34%"))
    assert report["settings"]["defaults"] is True
    assert report["batch"] == 10
    # issue 4's 6 writes per pod, plus issue 13's 3 Events on each pod (drained, updating,
    # verified); exactly those 3, with no repeat
    assert report["apiWritesPerPod"] <= 9
    assert report["apiWrites"]["pod-event"] == 3 * 30
    assert report["apiWrites"]["pod-status"] == 60  # one gate write each way per pod
    assert report["agentCalls"]["start_update"] == 30
    assert report["apiWrites"].get("conflict", 0) == 0  # one operator: no write refused


def test_a_lagging_watch_and_relists_still_finish_the_rollout() -> None:
    """Issue 27 C: the index sees writes 0.3 s late and is re-listed every 1.5 s (a 410)."""
    report = asyncio.run(_bench().run(30, 1.0, "34%", watch_lag=0.3, relist=1.5))
    assert report["watch"]["relists"] >= 1
    assert report["agentCalls"]["start_update"] == 30  # every pod updated exactly once
    assert report["apiWrites"]["pod-status"] >= 60


def test_the_api_double_never_mutates_an_object_it_handed_out() -> None:
    """The operator reuses the view of an unchanged pod object (``reconcile/selection.py``): the
    double's copy on write must leave the old object exactly as it was."""
    import copy

    bench = _bench()
    pods = bench.make_fleet(2)
    kube = bench.MemKube(pods, {})
    old = pods["vllm-00000"]
    before = copy.deepcopy(old)
    cond = {"type": "weightroll.io/weights-ready", "status": "False"}
    asyncio.run(kube.patch_pod_condition(bench.NS, "vllm-00000", cond, resource_version="1"))
    asyncio.run(
        kube.patch_pod_metadata(
            bench.NS, "vllm-00000", annotations={"a": "b"}, labels={"l": "v"}, resource_version="2"
        )
    )
    assert old == before
    new = pods["vllm-00000"]
    assert new is not old and new["metadata"]["resourceVersion"] == "3"
    assert new["metadata"]["annotations"] == {"a": "b"} and new["metadata"]["labels"]["l"] == "v"
    assert {"type": "Ready", "status": "False"} in new["status"]["conditions"]


def test_a_prefetched_rollout_swaps_every_pod_once_and_reads_ahead_of_the_drain() -> None:
    """Issue 30 item 4: with ``strategy.prefetch.mode: Host`` each agent reads while its pod
    serves, parks in ``Prefetched`` and commits only after the operator's swap."""
    report = asyncio.run(_bench().run(30, 1.0, "34%", prefetch_seconds=1.0, prefetch=True))
    assert report["prefetch"] == {"mode": "Host", "readSeconds": 1.0}
    assert report["agentCalls"]["start_update"] == 30
    assert report["agentCalls"]["swap_update"] == 30  # every pod swapped, exactly once
    assert report["apiWrites"]["pod-status"] == 60  # still one gate write each way per pod
    assert report["idealSeconds"] == 1.0 + 3 * 1.0  # one read on the critical path


def test_without_prefetch_the_read_is_inside_the_drain() -> None:
    report = asyncio.run(_bench().run(30, 1.0, "34%", prefetch_seconds=1.0))
    assert report["prefetch"]["mode"] == "None"
    assert report["agentCalls"].get("swap_update", 0) == 0
    assert report["idealSeconds"] == 3 * (1.0 + 1.0)
