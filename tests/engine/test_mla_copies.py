"""Gap 3 where MLA's derived tensors do not alias ``kv_b_proj`` (a quantized ``kv_b_proj``, as
in FP8 DeepSeek-V3/R1): a full update must still equal a cold engine on the new weights.

Its own module: an in-process engine started and shut down while another is alive tears down
state the live one still uses, so this engine must not overlap ``test_moe_mla``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.engines import Engine, cold_outputs, environ, start_engine
from tests.harness.mla import absorbed_weights
from tests.harness.probe_extension import MLA_COPIES_ENV


def _only(reports: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(reports) == 1
    return reports[0]


@pytest.fixture(scope="module")
def mla_copies(checkpoints: Callable[[str, int], Path]) -> Iterator[dict[str, Any]]:
    """An MLA engine whose ``W_UK_T``/``W_UV`` are tensors of their own, as with a quantized
    ``kv_b_proj`` (see ``install_mla_private_copies``), and the cold reference built alike."""
    a, b = checkpoints("deepseek_v2", 0), checkpoints("deepseek_v2", 1)
    with environ({MLA_COPIES_ENV: "1"}):
        cold_b = cold_outputs(b)
        engine = start_engine(a)
        try:
            yield {"a": a, "b": b, "engine": engine, "cold_b": cold_b, "boot": engine.outputs()}
        finally:
            engine.close()


def test_gap3_mla_derived_tensors_of_their_own_are_refreshed(mla_copies: dict[str, Any]) -> None:
    """Found after gap 3 was "resolved": the refresher ran while the loader's guards stood in
    for the layer's parameters, so it wrote the new ``W_UV`` into a placeholder and the kernels
    kept reading A's. It passed only where the derived tensors alias ``kv_b_proj``."""
    engine: Engine = mla_copies["engine"]
    before = engine.llm.collective_rpc("probe_storage", args=("{}",))[0]
    _, w_uk, w_uv = absorbed_weights(before)
    assert _only(engine.update("mla-copies-b", "b", mla_copies["b"]))["ok"]
    after = engine.outputs()
    assert after == mla_copies["cold_b"], (
        f"max logprob diff {after.max_logprob_diff(mla_copies['cold_b'])}"
    )
    # refreshed in the storage the kernels captured
    after_storage = engine.llm.collective_rpc("probe_storage", args=("{}",))[0]
    assert (after_storage[w_uk], after_storage[w_uv]) == (before[w_uk], before[w_uv])
    assert _only(engine.update("mla-copies-a", "a", mla_copies["a"]))["ok"]
    assert engine.outputs() == mla_copies["boot"]
