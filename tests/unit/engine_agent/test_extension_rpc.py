"""The sidecar and the worker extension share one list of RPC names, and the engine's import
structure has no cycle through the extension.

* every :class:`~engine_agent.protocol.ExtensionRpc` member names a method
  ``WeightRollExtension`` defines, taking the one JSON string; every ``weightroll_*`` method of
  the extension is a member, so neither side can rename alone;
* the sidecar hands ``collective_rpc`` only members (typed, so ``mypy --strict`` refuses a bare
  string, and no call site passes a literal);
* nothing below the extension imports it, lazily or not (the backends used to reach the rank
  engine through it while it imported them); the backends and the RPCs drive one rank engine,
  from :mod:`engine_agent.reload.registry`.
"""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine_agent.protocol import ExtensionRpc
from engine_agent.sidecar.engine import VllmClient

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "engine_agent"
EXTENSION = "engine_agent.vllm_extension"


def _extension_methods() -> dict[str, Callable[..., Any]]:
    pytest.importorskip("vllm", reason="the extension module registers vLLM backends")
    from engine_agent.vllm_extension import WeightRollExtension

    return {
        name: member
        for name, member in inspect.getmembers(WeightRollExtension, inspect.isfunction)
        if name.startswith("weightroll_")
    }


def test_every_rpc_name_is_an_extension_method_taking_one_json_string() -> None:
    methods = _extension_methods()
    missing = [rpc.value for rpc in ExtensionRpc if rpc.value not in methods]
    assert missing == [], "ExtensionRpc names methods WeightRollExtension does not define"
    for rpc in ExtensionRpc:
        params = list(inspect.signature(methods[rpc.value]).parameters)
        assert len(params) == 2, f"{rpc.value}{params}: collective_rpc passes one JSON string"


def test_every_extension_method_is_an_rpc_name() -> None:
    unnamed = sorted(set(_extension_methods()) - {rpc.value for rpc in ExtensionRpc})
    assert unnamed == [], "add these to engine_agent.protocol.ExtensionRpc"


def test_the_sidecar_hands_collective_rpc_only_rpc_names() -> None:
    hints = typing.get_type_hints(VllmClient.collective_rpc)
    assert hints["method"] is ExtensionRpc  # mypy --strict refuses a bare string at callers
    literals = []
    for file in sorted((PACKAGE / "sidecar").glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "collective_rpc"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                literals.append(f"{file.name}:{node.lineno}")
    assert literals == []


def _imported_modules(tree: ast.AST, package: str) -> set[str]:
    """Every module an import statement anywhere in ``tree`` names (inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("below", ["transfer", "reload"])
def test_nothing_below_the_extension_imports_it(below: str) -> None:
    importers = []
    for file in sorted((PACKAGE / below).rglob("*.py")):
        package = "engine_agent." + ".".join(file.relative_to(PACKAGE).parent.parts)
        if EXTENSION in _imported_modules(ast.parse(file.read_text()), package):
            importers.append(str(file.relative_to(ROOT)))
    assert importers == [], "use engine_agent.reload.registry (docs/engine.md, Layers)"


def test_the_backends_and_the_rpcs_drive_one_rank_engine() -> None:
    pytest.importorskip("vllm")
    import torch

    from engine_agent.transfer.verified import VerifiedReceiver
    from engine_agent.vllm_extension import WeightRollExtension

    model = torch.nn.Linear(2, 2)
    config = SimpleNamespace(
        model_config=SimpleNamespace(dtype=torch.float32),
        parallel_config=SimpleNamespace(enable_expert_parallel=False, data_parallel_index=0),
    )

    class Worker(WeightRollExtension):
        model_runner = SimpleNamespace(get_model=lambda: model)
        vllm_config = config

    by_rpc = Worker()._weightroll_engine()
    assert VerifiedReceiver(model, config).engine is by_rpc
    assert VerifiedReceiver(model, config).engine is Worker()._weightroll_engine()
