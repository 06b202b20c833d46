"""Chart tier: the PrometheusRule passes `promtool check rules` and its unit tests.

promtool cannot read a PrometheusRule CR, so the rendered object's ``spec`` (the rule groups) is
written to ``rules.yaml`` next to a copy of ``alerts_test.yaml`` and promtool runs on those.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.charts.helpers import ALERTS, find, objects, render, scenario_values

HERE = Path(__file__).resolve().parent
UNIT_TESTS = HERE / "alerts_test.yaml"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed: run `bash scripts/system-deps.sh` (apt prometheus)")
    return path


def _write_rules(values: dict[str, Any], out: Path) -> Path:
    pr = find(objects(render(values)), "PrometheusRule")
    path = out / "rules.yaml"
    path.write_text(yaml.safe_dump(pr["spec"], sort_keys=False))
    return path


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120
    )


@pytest.mark.parametrize("scenario", ["(enabled)", "monitoring-values.yaml"])
def test_promtool_check_rules(scenario: str, tmp_path: Path) -> None:
    if scenario == "(enabled)":
        values: dict[str, Any] = {"prometheusRule": {"enabled": True}}
    else:
        values = scenario_values(scenario)
    rules = _write_rules(values, tmp_path)
    proc = _run("check", "rules", "--lint=all", "--lint-fatal", rules.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in proc.stdout


def test_promtool_unit_tests(tmp_path: Path) -> None:
    _write_rules({"prometheusRule": {"enabled": True}}, tmp_path)
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    proc = _run("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_firing_and_silent_unit_tests() -> None:
    suite = yaml.safe_load(UNIT_TESTS.read_text())
    firing: set[str] = set()
    silent: set[str] = set()
    for group in suite["tests"]:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    assert firing == set(ALERTS)
    assert silent == set(ALERTS)


def test_unit_tests_fail_on_a_broken_rule(tmp_path: Path) -> None:
    """A wrong severity makes promtool fail: the suite really compares alerts."""
    rules = _write_rules(
        {
            "prometheusRule": {
                "enabled": True,
                "customRules": {"WeightrollAgentUnreachable": {"severity": "critical"}},
            }
        },
        tmp_path,
    )
    assert rules.is_file()
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    proc = _run("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert proc.returncode != 0
    assert 'severity="critical"' in proc.stdout + proc.stderr
