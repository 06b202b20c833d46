"""docs/architecture.md names what the code names: the import contracts it mirrors, the pod-level
state names, the unit states, the timer interval, and a row for every fault issue 6 lists."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

from weightroll_operator.domain import model
from weightroll_operator.settings import FINALIZER, OperatorConfig

from engine_agent.protocol import EngineState

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "docs" / "architecture.md").read_text()


def test_mirrors_the_import_contracts() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    sources = {
        line.strip()
        for section in config.sections()
        if section.startswith("importlinter:contract:")
        for line in config[section].get("source_modules", "").split()
    }
    assert sources, ".importlinter has no contracts"
    for module in sources:
        short = module.removeprefix("engine_agent.")
        assert f"`{module}`" in TEXT or short in TEXT.lower(), module


def test_names_the_pod_state_and_its_values() -> None:
    for name in (
        model.CONDITION_WEIGHTS_READY,
        model.ANNOTATION_WEIGHT_STATE,
        model.ANNOTATION_OWNER,
        model.LABEL_WEIGHT_VERSION,
        FINALIZER,
    ):
        assert f"`{name}`" in TEXT, name
    for state in model.UnitState:
        assert f"`{state.value}`" in TEXT, state
    for engine_state in EngineState:
        assert f"`{engine_state.value}`" in TEXT, engine_state


def test_timer_interval_is_the_default() -> None:
    assert f"{OperatorConfig().interval:g} s" in TEXT


def test_every_fault_has_a_row() -> None:
    faults = re.findall(r"^\| \*\*([^*]+)\*\*", TEXT.split("## Faults", 1)[1], re.M)
    wanted = [
        "Agent unreachable",
        "A rank fails",
        "Corrupt checkpoint",
        "Operator restarted",
        "Pod deleted",
        "vLLM restarted",
        "Progress deadline",
    ]
    for fault in wanted:
        assert any(f.startswith(fault) for f in faults), fault


def test_has_a_sequence_diagram() -> None:
    assert "```mermaid\nsequenceDiagram" in TEXT
