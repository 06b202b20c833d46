"""Smoke test of bench/operator_scale.py at a small size (the full run is the benchmark)."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench" / "operator_scale.py"


def test_small_fleet_meets_the_write_budget() -> None:
    spec = importlib.util.spec_from_file_location("operator_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = asyncio.run(module.run(50, 0.2, 0.01, "10%"))
    assert report["batch"] == 5
    # issue 4's 6 writes per pod, plus issue 13's 3 Events on each pod (drained, updating,
    # verified); exactly those 3, with no repeat
    assert report["apiWritesPerPod"] <= 9
    assert report["apiWrites"]["pod-event"] == 3 * 50
    assert report["apiWrites"]["pod-status"] == 100  # one gate write each way per pod
    assert report["agentCalls"]["start_update"] == 50
