"""Every benchmark runs the way its docstring says (``python bench/<name>.py``), from a checkout.

``python bench/operator_scale.py`` once failed with ``No module named 'bench'``: run as a script,
Python puts ``bench/`` on the path, not the checkout. ``--help`` is enough to import everything
a script imports at the top; the benchmarks themselves are smoke-tested elsewhere.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.machine import VECTOR_FLAGS, machine

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name != "machine.py")


def test_every_benchmark_is_listed() -> None:
    assert {"agent.py", "operator_scale.py", "reload.py", "trainer.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_as_documented(script: str) -> None:
    assert f"bench/{script}" in (ROOT / "bench" / script).read_text(), "docstring names its usage"
    run = subprocess.run(
        [sys.executable, f"bench/{script}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in (run.stdout + run.stderr).lower()


def test_machine_names_cpu_and_vector_flags() -> None:
    described = machine()
    assert set(described) == {"cpu", "cpuFlags", "cores", "loadAverage"}
    flags = described["cpuFlags"]
    assert isinstance(flags, list) and set(flags) <= set(VECTOR_FLAGS)
    json.dumps(described)
