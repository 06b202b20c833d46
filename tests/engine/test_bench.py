"""The reload benchmark runs and prints the figures it promises (no timing assertions here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_reload_benchmark_prints_one_json_object_on_stdout(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "reload.py"),
            "--layers",
            "1",
            "--hidden",
            "256",
            "--vocab",
            "1024",
            "--rounds",
            "1",
            "--out",
            str(tmp_path / "bench.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # stdout is exactly the report: vLLM's log lines go to stderr.
    report = json.loads(run.stdout)
    assert report == json.loads((tmp_path / "bench.json").read_text())
    assert "INFO" in run.stderr, "vLLM's logs should still be visible on stderr"
    assert set(report["median_seconds"]) == {
        "raw_copy",
        "vllm_reload",
        "verified",
        "prefetch",
        "window",
    }
    assert report["ratios"]["window_vs_vllm_reload"] > 0
    assert report["ratios"]["prefetch_plus_window_vs_vllm_reload"] > 0
    assert report["ratios"]["verified_vs_vllm_reload"] > 0
    assert 0 <= report["ratios"]["structural_checks_share_of_verified"] < 1
    assert 0 <= report["ratios"]["digest_share_of_verified"] < 1
    assert report["verification"].startswith("every tensor BLAKE3-checked")
    assert report["engine_serves_after"] is True
