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
    assert report["apiWritesPerPod"] <= 6
    assert report["apiWrites"]["pod-status"] == 60  # one gate write each way per pod
    assert report["agentCalls"]["start_update"] == 30
    assert report["apiWrites"].get("conflict", 0) == 0  # one operator: no write refused
