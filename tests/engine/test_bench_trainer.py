"""The trainer benchmark runs and prints the figures it promises (no timing assertions here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_benchmark_prints_the_ratio_as_json(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "trainer.py"),
            *("--layers", "1", "--hidden", "256", "--vocab", "1024", "--rounds", "1"),
            *("--out", str(tmp_path / "bench.json")),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report == json.loads((tmp_path / "bench.json").read_text())
    assert set(report["median_seconds"]) == {"stock", "verified"}
    assert len(report["all_seconds"]["verified"]) == 2
    assert report["ratios"]["verified_vs_stock"] > 0
    # The verified pushes committed (the last push of the run was a verified one or a stock one;
    # either way the rank must be clean).
    assert report["final_rank_state"]["state"] == "clean"
    assert report["engine_serves_after"] is True
