"""Still true now (issue 26 E, item 4): a committed rank that stops serving its commit says so.

After a verified commit the rank seals what its kernels read. Two things then change the live
bytes behind its back, on a real vLLM engine: a stray in-place write into one weight, and
vLLM's own ``reload_weights`` of another checkpoint (reachable through ``collective_rpc`` on the
pod-local dev routes). On the base commit the rank went on reporting ``clean`` at B after both.
Here the next ``state`` answer reports ``poisoned`` with ``still_true_violated`` naming the
tensor, and only a full update makes the rank clean again.

``WEIGHTROLL_GUARD_PERIOD_S=0`` makes every state answer read the content (the default period,
30 s, bounds detection time in production; its cost is reported by ``bench/reload.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.engines import Engine, environ, start_engine

NAME = "model.layers.0.input_layernorm.weight"


@pytest.fixture(scope="module")
def engine(checkpoints: Callable[[str, int], Path]) -> Iterator[Engine]:
    with environ({"WEIGHTROLL_GUARD_PERIOD_S": "0"}):
        live = start_engine(checkpoints("llama", 0))
        try:
            yield live
        finally:
            live.close()


def _commit_b(engine: Engine, b: Path, update_id: str) -> None:
    reports = engine.update(update_id, "b", b)
    assert all(r["ok"] for r in reports), reports
    (state,) = engine.state()
    assert (state["state"], state["version"]) == ("clean", "b")


def _poisoned_naming(state: dict[str, Any], name: str) -> None:
    assert state["state"] == "poisoned", state
    assert state["servingSafe"] is False
    assert state["poisonReason"].startswith("still_true_violated"), state
    assert name in state["poisonReason"], state


def test_a_stray_write_into_a_committed_weight_is_found(
    engine: Engine, checkpoints: Callable[[str, int], Path]
) -> None:
    b = checkpoints("llama", 1)
    _commit_b(engine, b, "stray-1")
    engine.llm.collective_rpc("probe_stray_write", args=(f'{{"name": "{NAME}"}}',))
    (state,) = engine.state()
    _poisoned_naming(state, NAME)
    _commit_b(engine, b, "stray-2")  # a full update re-establishes the promise


def test_vllms_own_reload_of_other_weights_is_found(
    engine: Engine, checkpoints: Callable[[str, int], Path]
) -> None:
    a, b = checkpoints("llama", 0), checkpoints("llama", 1)
    _commit_b(engine, b, "foreign-1")
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(a)})
    (state,) = engine.state()
    _poisoned_naming(state, "model.")
    _commit_b(engine, b, "foreign-2")


def test_an_untouched_commit_stays_clean(
    engine: Engine, checkpoints: Callable[[str, int], Path]
) -> None:
    _commit_b(engine, checkpoints("llama", 1), "untouched")
    for _ in range(3):
        (state,) = engine.state()
        assert (state["state"], state["version"]) == ("clean", "b"), state
