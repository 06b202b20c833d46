"""Chart tier: rendered manifests pass `kubernetes-validate --strict`; YAML files pass yamllint.

kubernetes-validate checks built-in kinds only (a CustomResourceDefinition is built in; the
ServiceMonitor and PrometheusRule are CRs and only warn). WeightUpdate objects are checked against
their CRD by the operator's own tests.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.charts.helpers import CHART, REPO, SCENARIOS, objects, render, scenario_values

BIN = Path(sys.executable).parent
#: Oldest and newest schema versions kubernetes-validate 1.37 ships.
KUBE_VERSIONS = ("1.25.0", "1.37.0")


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return path


def _write_objects(values: dict[str, object], out: Path) -> list[Path]:
    files = []
    for i, obj in enumerate(objects(render(values))):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False))
        files.append(path)
    return files


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("scenario", ["(defaults)", *SCENARIOS])
def test_kubernetes_validate_strict(scenario: str, kube_version: str, tmp_path: Path) -> None:
    values = {} if scenario == "(defaults)" else scenario_values(scenario)
    files = _write_objects(values, tmp_path)
    proc = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", "-k", kube_version, *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout.upper().replace("NO ERROR", ""), proc.stdout


def test_kubernetes_validate_catches_unknown_fields(tmp_path: Path) -> None:
    """The check above would notice a misspelt field (guards against a silent no-op)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\n"
        "spec: {ports: [{port: 80, targtPort: 8080}]}\n"
    )
    proc = subprocess.run(
        [_tool("kubernetes-validate"), "--strict", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "targtPort" in proc.stdout + proc.stderr


YAMLLINT_CONFIG = """
extends: default
rules:
  # Alert annotations, series selectors and generated CRD descriptions are long on purpose.
  line-length: disable
  document-start: disable
  truthy: {check-keys: false}
  comments: {min-spaces-from-content: 1}
  indentation: {indent-sequences: whatever}
"""


def test_yamllint(tmp_path: Path) -> None:
    """yamllint on non-template YAML: values, scenarios, alert tests, and rendered output."""
    rendered = tmp_path / "rendered"
    rendered.mkdir()
    for scenario in SCENARIOS:
        for path, text in render(scenario_values(scenario)).items():
            if path.endswith(".yaml") and text.strip():
                (rendered / f"{scenario}-{Path(path).name}").write_text(text)
    files = [
        CHART / "Chart.yaml",
        CHART / "values.yaml",
        *sorted((CHART / "ci").glob("*.yaml")),
        REPO / "tests" / "charts" / "alerts_test.yaml",
        *sorted(rendered.glob("*.yaml")),
    ]
    config = tmp_path / "yamllint.yaml"
    config.write_text(YAMLLINT_CONFIG)
    proc = subprocess.run(
        [_tool("yamllint"), "-s", "-c", str(config), *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
