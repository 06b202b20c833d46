"""Verified reload on real MoE (Qwen2-MoE) and MLA (DeepSeek-V2) vLLM engines on CPU.

Issue 2 acceptance 1, 2, 4 (experts) and 5 (gap 3: MLA derived state, full and sparse).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_agent.reload.sparse import write_patch
from tests.harness.engines import Engine, cold_outputs, start_engine
from tests.harness.mla import LAYER0, absorbed_weights, releases_kv_b_proj
from tests.harness.models import load_tensors, random_checkpoint, write_subset, write_tensors


def _only(reports: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(reports) == 1
    return reports[0]


# ----------------------------------------------------------------------------------- MoE


@pytest.fixture(scope="module")
def moe(checkpoints: Callable[[str, int], Path]) -> Iterator[dict[str, Any]]:
    a, b = checkpoints("qwen2_moe", 0), checkpoints("qwen2_moe", 1)
    cold_b = cold_outputs(b)
    engine = start_engine(a)
    boot = engine.outputs()
    yield {"a": a, "b": b, "cold_b": cold_b, "engine": engine, "boot": boot}
    engine.close()


def test_moe_full_update_equals_cold_engine_and_round_trips(moe: dict[str, Any]) -> None:
    engine: Engine = moe["engine"]
    to_b = _only(engine.update("moe-b", "b", moe["b"]))
    assert to_b["ok"], to_b
    assert any("kernel_format" in name for name in to_b["derivedRefreshed"]), (
        "the experts' packed kernel layout must be rebuilt on every update"
    )
    after = engine.outputs()
    assert after.tokens != moe["boot"].tokens
    # Upstream's own MoE reload drifts (up to 0.107 nats measured); ours replays the experts'
    # kernel-format step, so the result is the cold engine's to the last bit.
    assert after == moe["cold_b"], f"max logprob diff {after.max_logprob_diff(moe['cold_b'])}"
    back = _only(engine.update("moe-a", "a", moe["a"]))
    assert back["ok"]
    assert engine.outputs() == moe["boot"]


def test_moe_missing_w3_of_one_expert_is_named(moe: dict[str, Any], tmp_path: Path) -> None:
    engine: Engine = moe["engine"]
    missing = "model.layers.1.mlp.experts.2.up_proj.weight"
    partial = write_subset(moe["b"], tmp_path / "no_w3.safetensors", lambda n: n != missing)
    report = _only(engine.update("moe-w3", "b", partial))
    assert not report["ok"] and report["error"]["code"] == "coverage_incomplete"
    assert report["missing"] == ["model.layers.1.mlp.experts.routed_experts.w13_weight[e2:w3]"]
    assert report["state"] == "poisoned"
    assert _only(engine.update("moe-recover", "a", moe["a"]))["ok"]
    assert engine.outputs() == moe["boot"]


# ----------------------------------------------------------------------------------- MLA

KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def mla(
    checkpoints: Callable[[str, int], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    a, b = checkpoints("deepseek_v2", 0), checkpoints("deepseek_v2", 1)
    root = tmp_path_factory.mktemp("mla")
    # A dense checkpoint equal to A except for a sparse set of kv_b_proj entries: the cold
    # reference for the sparse patch.
    tensors = load_tensors(a)
    original = tensors[KV_B]
    generator = torch.Generator().manual_seed(7)
    indices = torch.randperm(original.numel(), generator=generator)[: original.numel() // 20]
    values = (torch.randn(indices.numel(), generator=generator) * 0.2).to(original.dtype)
    patched = original.clone().reshape(-1)
    patched[indices] = values
    patched_dir = random_checkpoint(a, root / "patched", seed=0)
    write_tensors(
        patched_dir / "model.safetensors", {**tensors, KV_B: patched.reshape(original.shape)}
    )
    patch = write_patch(
        root / "kv_b.patch.safetensors", "a", {KV_B: (tuple(original.shape), indices, values)}
    )
    refs = {"cold_b": cold_outputs(b), "cold_patched": cold_outputs(patched_dir)}
    engine = start_engine(a)
    boot = engine.outputs()
    yield {"a": a, "b": b, "engine": engine, "boot": boot, "patch": patch, "root": root, **refs}
    engine.close()


def _ensure_clean_a(engine: Engine, mla: dict[str, Any]) -> None:
    state = _only(engine.state())
    if state["state"] != "clean" or state["version"] != "a":
        if state["state"] in ("open", "dirty"):
            engine.rpc("weightroll_abort")
        assert _only(engine.update(f"mla-restore-{state['version']}", "a", mla["a"]))["ok"]


def test_gap3_mla_full_update_refreshes_w_uk_t_and_w_uv(mla: dict[str, Any]) -> None:
    engine: Engine = mla["engine"]
    _ensure_clean_a(engine, mla)
    _, uk, uv = absorbed_weights(engine.llm.collective_rpc("probe_storage", args=("{}",))[0])
    report = _only(engine.update("mla-b", "b", mla["b"]))
    assert report["ok"], report
    refreshed = report["derivedRefreshed"]
    assert uk in refreshed and uv in refreshed, refreshed
    after = engine.outputs()
    assert after == mla["cold_b"], f"max logprob diff {after.max_logprob_diff(mla['cold_b'])}"
    assert _only(engine.update("mla-a", "a", mla["a"]))["ok"]
    assert engine.outputs() == mla["boot"]


def test_the_mla_refresher_lists_only_what_it_rebuilt(mla: dict[str, Any]) -> None:
    """Issue 26, item 8: the MLA layer's KV cache (and its attention scales) were reported as
    "refreshed" although no refresher rebuilds them: a report that lists what was not done
    cannot be trusted for what was."""
    engine: Engine = mla["engine"]
    _ensure_clean_a(engine, mla)
    storage = engine.llm.collective_rpc("probe_storage", args=("{}",))[0]
    report = _only(engine.update("mla-b-listed", "b", mla["b"]))
    assert report["ok"], report
    refreshed = report["derivedRefreshed"]
    for layer in (LAYER0, LAYER0.replace("layers.0.", "layers.1.")):
        _, uk, uv = absorbed_weights(storage, layer)
        assert sorted(n for n in refreshed if n.startswith(layer + ".")) == sorted([uk, uv])
    assert not [n for n in refreshed if n.endswith(".kv_cache") or "_scale" in n], refreshed
    assert _only(engine.update("mla-a-listed", "a", mla["a"]))["ok"]


def test_gap3_mla_sparse_patch_of_kv_b_proj_refreshes_derived_state(mla: dict[str, Any]) -> None:
    engine: Engine = mla["engine"]
    _ensure_clean_a(engine, mla)
    before = engine.llm.collective_rpc("probe_storage", args=("{}",))[0]
    backend, uk, uv = absorbed_weights(before)
    report = _only(
        engine.update("mla-sparse", "a-patched", mla["patch"], mode="sparse", baseVersion="a")
    )
    if releases_kv_b_proj(backend):
        # AMX_MLA keeps no kv_b_proj weight in checkpoint layout, only its packed W_UK/W_UV:
        # a patch in checkpoint coordinates has nothing correct to land on, so it is refused
        # before any write, naming the tensor, and the replica keeps serving A.
        assert not report["ok"] and report["error"]["code"] == "sparse_refused", report
        assert KV_B in report["error"]["message"], report["error"]
        assert report["state"] == "clean", report
        assert _only(engine.state())["version"] == "a"
        assert engine.llm.collective_rpc("probe_storage", args=("{}",))[0] == before
        assert engine.outputs() == mla["boot"]
        return
    assert report["ok"], report
    assert uk in report["derivedRefreshed"] and uv in report["derivedRefreshed"], report
    assert engine.llm.collective_rpc("probe_storage", args=("{}",))[0] == before
    after = engine.outputs()
    assert after != mla["boot"]
    assert after == mla["cold_patched"], f"max diff {after.max_logprob_diff(mla['cold_patched'])}"


def test_sparse_patch_of_a_packed_module_is_refused_naming_it(mla: dict[str, Any]) -> None:
    engine: Engine = mla["engine"]
    _ensure_clean_a(engine, mla)
    name = "model.layers.0.self_attn.q_proj.weight"
    shape = tuple(load_tensors(mla["a"])[name].shape)
    patch = write_patch(
        mla["root"] / "q.patch.safetensors",
        "a",
        {name: (shape, torch.tensor([0, 5]), torch.zeros(2, dtype=torch.bfloat16))},
    )
    report = _only(engine.update("mla-q", "a-q", patch, mode="sparse", baseVersion="a"))
    assert not report["ok"] and report["error"]["code"] == "sparse_refused"
    assert "model.layers.0.self_attn.q_proj" in report["error"]["message"]
    assert report["state"] == "clean" and report["version"] == "a"
    assert engine.outputs() == mla["boot"]


def test_sparse_patch_against_the_wrong_base_is_refused(mla: dict[str, Any]) -> None:
    engine: Engine = mla["engine"]
    _ensure_clean_a(engine, mla)
    report = _only(engine.update("mla-base", "c", mla["patch"], mode="sparse", baseVersion="b"))
    assert not report["ok"] and report["error"]["code"] == "wrong_state"
    assert "'b'" in report["error"]["message"] and "'a'" in report["error"]["message"]


def test_a_checkpoint_cannot_write_derived_state_directly(mla: dict[str, Any]) -> None:
    engine: Engine = mla["engine"]
    _ensure_clean_a(engine, mla)
    w_uv = "model.layers.0.self_attn.mla_attn.mla_attn.W_UV"
    sneaky = write_tensors(
        mla["root"] / "w_uv.safetensors", {w_uv: torch.zeros(4, 512, 32, dtype=torch.bfloat16)}
    )
    report = _only(
        engine.update(
            "mla-w-uv", "a-x", sneaky, mode="partial", scope=["model.layers.0."], baseVersion="a"
        )
    )
    assert not report["ok"] and report["error"]["code"] == "unknown_tensor", report
    assert "W_UV" in report["error"]["message"]
    assert report["state"] == "clean" and report["version"] == "a"
    assert engine.outputs() == mla["boot"]
