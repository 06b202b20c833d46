"""The bitwise census oracle (issue 26 B): after A->B, every tensor the kernels read equals cold B.

Logits can agree by luck on a tiny random model and can differ by kernel selection between two
processes; the bytes the kernels read cannot. For each model family the engine tier builds,
a cold engine on B gives the reference census (:mod:`tests.harness.census`: parameters,
buffers, tensors in module attributes and in kernel closures, found without weightroll's own
index). A warm engine started on A — its boot census *is* a cold engine on A — is updated A->B
and back B->A; after each update its census must equal the cold one byte for byte, and no
tensor may have moved (graph-captured addresses stay valid). A third update, A->B prefetched
(post-load on shadow modules before the drain, installed inside it), must give the same census.

Packed CPU GEMM copies (dense, tied) and MLA's private ``W_UK_T``/``W_UV`` copies (mla) are
switched on as in tests/engine/test_oracle.py, so the derived copies a real AVX-512/AMX or FP8
build keeps are in the census too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness.census import Entry, differences, moved
from tests.harness.engines import Engine, environ, start_engine
from tests.harness.probe_extension import MLA_COPIES_ENV, PACKED_GEMM_ENV

#: family -> (tiny-model kind, environment the kernels are built under, a derived copy the
#: census must reach for the comparison to cover it)
FAMILIES: dict[str, tuple[str, dict[str, str], str]] = {
    "dense": ("llama", {PACKED_GEMM_ENV: "1"}, "o_proj.cpu_linear<packed>"),
    "tied": ("llama-tied", {PACKED_GEMM_ENV: "1"}, "lm_head.cpu_linear<packed>"),
    "moe": ("qwen2_moe", {}, "gate_up_proj.cpu_linear<applied to the identity>"),
    "mla": ("deepseek_v2", {MLA_COPIES_ENV: "1"}, "W_UK_T"),
}


def _census(engine: Engine) -> dict[str, Entry]:
    (only,) = engine.llm.collective_rpc("probe_census")
    assert only, "the census found no tensor"
    return dict(only)


def _committed(reports: list[dict[str, Any]]) -> None:
    assert all(r["ok"] for r in reports), reports


@pytest.mark.parametrize("family", FAMILIES)
def test_update_equals_cold_engine_byte_for_byte(
    family: str, checkpoints: Callable[[str, int], Path]
) -> None:
    kind, env, derived = FAMILIES[family]
    a, b = checkpoints(kind, 0), checkpoints(kind, 1)
    with environ(env):
        cold = start_engine(b)
        try:
            cold_b = _census(cold)
        finally:
            cold.close()
        warm = start_engine(a)
        try:
            cold_a = _census(warm)  # nothing updated yet: a cold engine on A
            assert differences(cold_a, cold_b), "A and B must differ for the test to mean anything"
            assert any(derived in name for name in cold_a), f"the census must reach {derived}"
            _committed(warm.update("to-b", "b", b))
            after_b = _census(warm)
            _committed(warm.update("to-a", "a", a))
            after_a = _census(warm)
            # prefetched (issue 30): post-load on shadows before the drain, installed inside it
            _committed(warm.prefetched_update("prefetched-to-b", "b-again", b))
            prefetched_b = _census(warm)
        finally:
            warm.close()
    assert differences(after_b, cold_b) == []
    assert differences(after_a, cold_a) == []
    assert differences(prefetched_b, cold_b) == []
    assert moved(cold_a, after_b) == []
    assert moved(cold_a, after_a) == []
    assert moved(cold_a, prefetched_b) == []
