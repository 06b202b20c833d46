"""Fault table (issue 10, B): a failure at any step boundary never leaves a clean, changed rank.

One real engine (dense Llama with tied embeddings and packed CPU GEMM kernels, TP=1, so the
failpoints in engine_agent/reload/failpoints.py can be armed from this process). For every
failpoint the update either ends ``clean`` at the old version with every effective weight —
linears and the LM head read back through their kernels with an identity matrix — bit-identical
to before, or ``poisoned``. The table also says which of the two each point must give, and a
point missing from it fails the test.

``test_post_load_failure_after_the_kernel_swap_poisons`` reproduces issue 10 item 3 without
failpoints: vLLM's own linear post-load step raises after it swapped the kernel (as an OOM
there would on GPU). On main the rank stayed clean at the old version with that layer's
kernel reading the new weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_agent.reload import failpoints
from engine_agent.reload.sparse import write_patch
from tests.harness.engines import Engine, Outputs, environ, start_engine
from tests.harness.models import load_tensors
from tests.harness.probe_extension import PACKED_GEMM_ENV

#: (failpoint, mode, outcome). A point before the first kernel-visible change must leave the
#: rank clean; every later one must poison it.
TABLE = [
    ("begin", "full", "clean"),
    ("begin.snapshot", "full", "clean"),
    ("load", "full", "clean"),
    ("load.dry_run", "full", "clean"),
    ("load.staged", "full", "clean"),
    ("post_load.before", "full", "poisoned"),
    ("post_load.after", "full", "poisoned"),
    ("refresh.after", "full", "poisoned"),
    ("copy.before", "full", "poisoned"),
    ("copy.after", "full", "poisoned"),
    ("tied.before", "full", "poisoned"),
    ("tied.after", "full", "poisoned"),
    ("load.read", "full", "poisoned"),
    ("finish", "full", "poisoned"),
    ("finish.coverage", "full", "poisoned"),
    ("finish.identity", "full", "poisoned"),
    ("load", "sparse", "clean"),
    ("sparse.before_write", "sparse", "clean"),
    ("sparse.after_write", "sparse", "poisoned"),
    ("tied.before", "sparse", "poisoned"),
    ("finish.identity", "sparse", "poisoned"),
    # prefetched (issue 30): everything before the drain writes nothing; apply is load's twin
    ("prefetch", "prefetch", "clean"),
    ("prefetch.read", "prefetch", "clean"),
    ("prefetched", "prefetch", "clean"),
    ("apply", "prefetch", "clean"),
    ("load.staged", "prefetch", "clean"),
    ("prefetch.post_load", "prefetch", "clean"),
    ("prefetch.seal_digest", "prefetch", "clean"),
    ("copy.before", "prefetch", "poisoned"),
    ("copy.after", "prefetch", "poisoned"),
]


@pytest.fixture(scope="module")
def tied(
    checkpoints: Callable[[str, int], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    a, b = checkpoints("llama-tied", 0), checkpoints("llama-tied", 1)
    embed = load_tensors(a)["model.embed_tokens.weight"]
    indices = torch.arange(0, embed.numel(), 7)
    patch = write_patch(
        tmp_path_factory.mktemp("faults") / "embed.patch.safetensors",
        "a",
        {
            "model.embed_tokens.weight": (
                tuple(embed.shape),
                indices,
                torch.full((indices.numel(),), 0.25, dtype=embed.dtype),
            )
        },
    )
    with environ({PACKED_GEMM_ENV: "1"}):
        engine = start_engine(a)
        try:
            yield {"engine": engine, "a": a, "b": b, "patch": patch, "boot": engine.outputs()}
        finally:
            engine.close()


def _effective(engine: Engine) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = engine.llm.collective_rpc(
        "probe_dense_weights", args=("{}",)
    )[0]
    return weights


def _restore(tied: dict[str, Any]) -> None:
    engine: Engine = tied["engine"]
    state = engine.state()[0]
    if state["state"] == "clean" and state["version"] == "a":
        return
    restored = engine.update(f"restore-{len(state['version'])}", "a", tied["a"])
    assert restored[0]["ok"], restored
    boot: Outputs = tied["boot"]
    assert engine.outputs() == boot


def _assert_outcome(tied: dict[str, Any], before: dict[str, torch.Tensor], outcome: str) -> None:
    engine: Engine = tied["engine"]
    state = engine.state()[0]
    assert state["state"] == outcome, state
    if outcome == "clean":
        assert state["version"] == "a" and state["servingSafe"]
        after = _effective(engine)
        assert after.keys() == before.keys()
        changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
        assert changed == [], f"clean at the old version but kernels read new weights: {changed}"
        assert any(n.endswith("lm_head.kernel") for n in after), "the LM head kernel is probed"
    else:
        assert not state["servingSafe"]


def test_the_table_covers_every_failpoint() -> None:
    assert {point for point, _, _ in TABLE} == set(failpoints.POINTS)


@pytest.mark.parametrize(("point", "mode", "outcome"), TABLE, ids=[f"{p}-{m}" for p, m, _ in TABLE])
def test_a_failure_at_every_step_boundary_is_clean_and_unchanged_or_poisoned(
    tied: dict[str, Any], monkeypatch: pytest.MonkeyPatch, point: str, mode: str, outcome: str
) -> None:
    engine: Engine = tied["engine"]
    _restore(tied)
    before = _effective(engine)
    monkeypatch.setenv(failpoints.ENV, point)
    if mode == "full":
        reports = engine.update(f"fault-{mode}", "b", tied["b"])
    elif mode == "prefetch":
        reports = engine.prefetched_update(f"fault-{mode}", "b", tied["b"])
    else:
        reports = engine.update(
            f"fault-{mode}", "a-x", tied["patch"], mode="sparse", baseVersion="a"
        )
    monkeypatch.delenv(failpoints.ENV)
    report = reports[0]
    assert not report["ok"], report
    assert f"failpoint {point!r}" in report["error"]["message"], report["error"]
    _assert_outcome(tied, before, outcome)


def test_post_load_failure_after_the_kernel_swap_poisons(
    tied: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from tests.harness.models import write_subset

    engine: Engine = tied["engine"]
    _restore(tied)
    before = _effective(engine)
    mlp = write_subset(tied["b"], tmp_path / "mlp0.safetensors", lambda n: ".layers.0.mlp." in n)
    original = UnquantizedLinearMethod.process_weights_after_loading

    def swap_then_fail(self: Any, layer: torch.nn.Module) -> None:
        original(self, layer)  # the layer's kernel now reads the new weights
        raise RuntimeError("injected: out of memory after the kernel swap")

    monkeypatch.setattr(UnquantizedLinearMethod, "process_weights_after_loading", swap_then_fail)
    # The first module processed is a linear (gate_up_proj), so no live byte was copied yet.
    scope = {"mode": "partial", "scope": ["model.layers.0.mlp."], "baseVersion": "a"}
    report = engine.update("oom", "a-mlp0", mlp, **scope)[0]
    monkeypatch.undo()
    assert not report["ok"] and "out of memory" in report["error"]["message"], report
    _assert_outcome(tied, before, "poisoned")
    _restore(tied)


def _model(engine: Engine) -> Any:
    return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def test_the_inventory_classifies_what_the_kernels_read(tied: dict[str, Any]) -> None:
    engine: Engine = tied["engine"]
    items = engine.llm.collective_rpc("probe_inventory", args=("{}",))[0]
    assert items["lm_head.weight"] == {
        "kind": "checkpoint",
        "sources": ["model.embed_tokens"],
        "refresher": None,
    }
    assert items["lm_head.cpu_linear"] == {
        "kind": "derived",
        "sources": ["model.embed_tokens"],
        "refresher": "post_load:lm_head",
    }
    qkv = "model.layers.0.self_attn.qkv_proj"
    assert items[f"{qkv}.cpu_linear"]["sources"] == [qkv]
    assert items["model.layers.0.self_attn.attn.kv_cache"]["kind"] == "runtime"
    assert items["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]["kind"] == "runtime"


def test_derived_state_without_a_refresher_fails_begin_naming_module_and_attribute(
    tied: dict[str, Any], tmp_path: Path
) -> None:
    from tests.harness.models import write_subset

    engine: Engine = tied["engine"]
    _restore(tied)
    down = _model(engine).model.layers[0].mlp.down_proj
    # A kernel-side copy nothing in weightroll rebuilds (what vLLM#60009 calls a persistent
    # device tensor that is not a parameter or buffer).
    down.scales_copy = torch.ones(4)
    try:
        report = engine.update("stale", "b", tied["b"])[0]
        assert not report["ok"] and report["error"]["code"] == "derived_state_unsupported"
        message = report["error"]["message"]
        assert "model.layers.0.mlp.down_proj" in message and "scales_copy" in message, message
        assert report["state"] == "clean" and report["version"] == "a"
        # An update that does not touch that module is not affected.
        norm = write_subset(
            tied["b"], tmp_path / "norm.safetensors", lambda n: n == "model.norm.weight"
        )
        scope = {"mode": "partial", "scope": ["model.norm.weight"], "baseVersion": "a"}
        ok = engine.update("norm", "a-norm", norm, **scope)[0]
        assert ok["ok"], ok
    finally:
        del down.scales_copy
    _restore(tied)
