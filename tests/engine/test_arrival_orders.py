"""Arrival orders (issue 26 C): whatever order the shards arrive in, the commit equals cold.

Completion is counted per shard, staging is per module and a module is processed when its last
shard arrives — so the order in which tensors reach a rank must not matter. Each checkpoint is
split into one file per tensor and loaded one file per ``weightroll_load`` in a chosen order:
natural (sorted), reversed, layer-interleaved (round robin over layers), experts last, and
orders Hypothesis generates (shuffles, shrunk to a minimal failing order if one fails). After
every update the census oracle (tests/harness/census.py) must equal a cold engine on the target
checkpoint byte for byte, and nothing graph-visible may have moved. The warm engine alternates
A -> B -> A ..., so every example is a full update of every tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.harness.census import Entry, differences, moved
from tests.harness.engines import Engine, environ, start_engine
from tests.harness.models import load_tensors, write_tensors
from tests.harness.probe_extension import PACKED_GEMM_ENV

FAMILIES: dict[str, tuple[str, dict[str, str]]] = {
    "dense": ("llama", {PACKED_GEMM_ENV: "1"}),
    "moe": ("qwen2_moe", {}),
}
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def _census(engine: Engine) -> dict[str, Entry]:
    (only,) = engine.llm.collective_rpc("probe_census")
    return dict(only)


def _split(model_dir: Path, out: Path) -> dict[str, Path]:
    """One safetensors file per tensor: name -> file."""
    files = {}
    for i, (name, tensor) in enumerate(sorted(load_tensors(model_dir).items())):
        files[name] = write_tensors(out / f"{i:04d}.safetensors", {name: tensor})
    return files


def natural(names: list[str]) -> list[str]:
    return sorted(names)


def reverse(names: list[str]) -> list[str]:
    return sorted(names, reverse=True)


def layer_interleaved(names: list[str]) -> list[str]:
    """Round robin over layers: every layer's first tensor, then every layer's second, ..."""
    by_layer: dict[int, list[str]] = {}
    for name in sorted(names):
        found = _LAYER.search(name)
        by_layer.setdefault(int(found.group(1)) if found else -1, []).append(name)
    rows = list(by_layer.values())
    return [row[i] for i in range(max(map(len, rows))) for row in rows if i < len(row)]


def experts_last(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: (".experts." in n, n))


NAMED_ORDERS: dict[str, Callable[[list[str]], list[str]]] = {
    "natural": natural,
    "reversed": reverse,
    "layer-interleaved": layer_interleaved,
    "experts-last": experts_last,
}


@dataclass
class Rig:
    engine: Engine
    files: dict[str, dict[str, Path]]
    cold: dict[str, dict[str, Entry]]
    boot: dict[str, Entry]
    current: str = "a"
    updates: int = 0

    def update_in(self, order: list[str]) -> None:
        target = "b" if self.current == "a" else "a"
        self.updates += 1
        paths = [self.files[target][name] for name in order]
        reports = self.engine.update(f"order-{self.updates}", target, *paths)
        assert all(r["ok"] for r in reports), reports
        census = _census(self.engine)
        assert differences(census, self.cold[target]) == []
        assert moved(self.boot, census) == []
        self.current = target


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def rig(
    request: pytest.FixtureRequest,
    checkpoints: Callable[[str, int], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Rig]:
    kind, env = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(f"orders-{request.param}")
    dirs = {"a": checkpoints(kind, 0), "b": checkpoints(kind, 1)}
    files = {label: _split(path, root / label) for label, path in dirs.items()}
    with environ(env):
        cold: dict[str, Any] = {}
        engine = start_engine(dirs["b"])
        try:
            cold["b"] = _census(engine)
        finally:
            engine.close()
        engine = start_engine(dirs["a"])
        try:
            cold["a"] = _census(engine)  # the warm engine's boot census: a cold engine on A
            yield Rig(engine, files, cold, boot=cold["a"])
        finally:
            engine.close()


@pytest.mark.parametrize("order", sorted(NAMED_ORDERS))
def test_named_orders_commit_what_a_cold_engine_reads(rig: Rig, order: str) -> None:
    names = list(rig.files["a"])
    rig.update_in(NAMED_ORDERS[order](names))


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
@example(data=None)
def test_generated_orders_commit_what_a_cold_engine_reads(rig: Rig, data: Any) -> None:
    names = sorted(rig.files["a"])
    order = names if data is None else data.draw(st.permutations(names), label="order")
    rig.update_in(order)
