"""The single-engine demo, ``make demo-engine``, runs to the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from weightroll_dev import checkout_pythonpath


def test_demo_runs_both_scenarios_and_exits_cleanly(tmp_path: Path) -> None:
    env = os.environ | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONPATH": checkout_pythonpath(),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "weightroll_dev",
            "demo",
            "--engine",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert '"state": "clean", "version": "b"' in out
    assert "qkv_proj.weight[k]" in out and '"state": "poisoned"' in out
    assert out.count("-> tokens") == 3
    on_a, on_b, recovered = (
        line.split("-> tokens")[1] for line in out.splitlines() if "-> tokens" in line
    )
    assert on_a != on_b, "the answer changes at the commit"
    assert recovered == on_b, "the recovered engine serves exactly B again"
