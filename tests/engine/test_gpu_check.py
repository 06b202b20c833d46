"""The prepared GPU check (bench/gpu_check.py, issue 26 G) runs in CI in its CPU dry run.

The real run needs a GPU this project's CI does not have; the dry run goes through the same
steps (cold censuses, A->B full and sparse on a warm engine, census equality, addresses kept,
fingerprint and guard timings), so the script a GPU machine runs cannot rot unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_check_passes_in_its_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    run = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report == json.loads(out.read_text())
    assert report["dryRun"] is True and report["passed"] is True
    for model in ("dense", "moe"):
        checked = report[model]
        assert checked["committed"] and checked["census_tensors"] > 0
        assert checked["full_equals_cold"] == checked["sparse_equals_cold"] == []
        assert checked["graph_addresses_moved"] == []
        assert checked["guard_check_s"] >= 0
    assert report["fingerprint_gb_per_s"] > 0
    assert report["machine"]["cpu"]


def test_without_a_gpu_the_real_run_says_so() -> None:
    run = subprocess.run(
        [sys.executable, "bench/gpu_check.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--dry-run" in run.stderr
