"""Verified reload on a real dense (Llama-style) vLLM engine on CPU.

Covers issue 2 acceptance 1-4 and 6-8 for the dense model. Every test starts from the engine
clean at version "a" (``engine_at_a``), so tests are order-independent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_agent.reload.sparse import write_patch
from tests.harness.engines import Engine, Outputs, cold_outputs, start_engine
from tests.harness.models import load_tensors, write_subset, write_tensors

QKV0 = "model.layers.0.self_attn.qkv_proj.weight"


@pytest.fixture(scope="module")
def dense(checkpoints: Callable[[str, int], Path]) -> dict[str, Any]:
    a, b = checkpoints("llama", 0), checkpoints("llama", 1)
    return {"a": a, "b": b, "cold_b": cold_outputs(b)}


@pytest.fixture(scope="module")
def engine(dense: dict[str, Any]) -> Iterator[Engine]:
    eng = start_engine(dense["a"])
    eng.boot_outputs = eng.outputs()  # type: ignore[attr-defined]
    yield eng
    eng.close()


@pytest.fixture
def engine_at_a(engine: Engine, dense: dict[str, Any]) -> Engine:
    """The engine, clean at version "a" (restored by a full update if a test left it elsewhere)."""
    state = engine.state()[0]
    if state["state"] != "clean" or state["version"] != "a":
        if state["state"] in ("open", "dirty"):
            engine.rpc("weightroll_abort")
        restored = engine.update(f"restore-{state['version']}-{id(state)}", "a", dense["a"])
        assert restored[0]["ok"], restored
    return engine


def _only(reports: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(reports) == 1
    return reports[0]


def test_full_update_equals_cold_engine_and_round_trip_is_bit_identical(
    engine_at_a: Engine, dense: dict[str, Any]
) -> None:
    engine = engine_at_a
    boot: Outputs = engine.boot_outputs  # type: ignore[attr-defined]
    to_b = _only(engine.update("to-b", "b", dense["b"]))
    assert to_b["ok"] and to_b["state"] == "clean" and to_b["version"] == "b", to_b
    assert to_b["missingCount"] == 0 and to_b["received"] == to_b["required"] == 21
    assert to_b["digest"] and to_b["coverageHash"]
    after_b = engine.outputs()
    assert after_b.tokens != boot.tokens, "the new checkpoint must change the outputs"
    assert after_b == dense["cold_b"], "A->B must equal a cold engine loaded with B, exactly"

    back = _only(engine.update("to-a", "a", dense["a"]))
    assert back["ok"] and back["version"] == "a"
    assert engine.outputs() == boot, "A->B->A must give bit-identical logprobs to the first load"


def test_live_weights_read_back_equal_the_checkpoint(
    engine_at_a: Engine, dense: dict[str, Any]
) -> None:
    engine = engine_at_a
    assert _only(engine.update("to-b-readback", "b", dense["b"]))["ok"]
    live = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0]
    ckpt = load_tensors(dense["b"])
    qkv = torch.cat([ckpt[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(live[QKV0], qkv)
    down = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(live[down], ckpt[down])
    assert torch.equal(live["model.norm.weight"], ckpt["model.norm.weight"])


def test_storage_identity_is_unchanged_by_a_commit(
    engine_at_a: Engine, dense: dict[str, Any]
) -> None:
    engine = engine_at_a
    before = engine.llm.collective_rpc("probe_storage", args=("{}",))[0]
    report = _only(engine.update("identity", "b", dense["b"]))
    assert report["ok"] and report["identityOk"], report
    after = engine.llm.collective_rpc("probe_storage", args=("{}",))[0]
    assert before and after == before


def test_gap1_half_failed_update_poisons_until_a_full_update_commits(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    engine = engine_at_a
    boot: Outputs = engine.boot_outputs  # type: ignore[attr-defined]
    layer0 = write_subset(dense["b"], tmp_path / "layer0.safetensors", lambda n: ".layers.0." in n)
    begin = _only(engine.rpc("weightroll_begin", {"updateId": "half", "version": "b"}))
    assert begin["ok"] and begin["state"] == "open"
    loaded = _only(engine.rpc("weightroll_load", {"path": str(layer0)}))
    assert loaded["ok"] and loaded["state"] == "dirty" and loaded["modulesProcessed"] == 6
    finish = _only(engine.rpc("weightroll_finish"))
    assert not finish["ok"] and finish["error"]["code"] == "coverage_incomplete"
    assert finish["state"] == "poisoned" and "model.layers.1" in finish["error"]["message"]
    assert engine.state()[0]["servingSafe"] is False

    # An empty begin/finish must not re-enable serving on the mixed weights.
    assert _only(engine.rpc("weightroll_begin", {"updateId": "empty", "version": "c"}))["ok"]
    empty = _only(engine.rpc("weightroll_finish"))
    assert not empty["ok"] and empty["state"] == "poisoned"
    # Partial and sparse updates would take the mixed state as their base: refused.
    partial = _only(
        engine.rpc(
            "weightroll_begin",
            {
                "updateId": "p",
                "version": "c",
                "mode": "partial",
                "scope": ["model.norm.weight"],
                "baseVersion": "a",  # what the ranks last committed: refused for the poison
            },
        )
    )
    assert not partial["ok"] and partial["error"]["code"] == "wrong_state"
    sparse = _only(
        engine.rpc(
            "weightroll_begin",
            {"updateId": "s", "version": "c", "mode": "sparse", "baseVersion": "a"},
        )
    )
    assert not sparse["ok"] and sparse["state"] == "poisoned"

    # Only a complete full update recovers, and then the outputs are exactly A's.
    recovered = _only(engine.update("recover", "a", dense["a"]))
    assert recovered["ok"] and recovered["state"] == "clean"
    assert engine.outputs() == boot


def test_gap1_aborted_update_poisons(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    engine = engine_at_a
    norms = write_subset(dense["b"], tmp_path / "norms.safetensors", lambda n: "norm" in n)
    assert _only(engine.rpc("weightroll_begin", {"updateId": "ab", "version": "b"}))["ok"]
    assert _only(engine.rpc("weightroll_load", {"path": str(norms)}))["state"] == "dirty"
    aborted = _only(engine.rpc("weightroll_abort"))
    assert aborted["state"] == "poisoned"
    assert "aborted" in engine.state()[0]["poisonReason"]


def test_untouched_failed_session_leaves_the_engine_clean(engine_at_a: Engine) -> None:
    engine = engine_at_a
    assert _only(engine.rpc("weightroll_begin", {"updateId": "noop", "version": "b"}))["ok"]
    finish = _only(engine.rpc("weightroll_finish"))
    assert not finish["ok"] and finish["state"] == "clean" and finish["version"] == "a"


def test_gap2_q_without_k_and_v_fails_naming_the_missing_shards(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    engine = engine_at_a
    before = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0]
    no_kv = write_subset(
        dense["b"],
        tmp_path / "no_kv.safetensors",
        lambda n: (
            not n.startswith(("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"))
        ),
    )
    report = _only(engine.update("q-only", "b", no_kv))
    assert not report["ok"] and report["error"]["code"] == "coverage_incomplete"
    assert report["missing"] == [f"{QKV0}[k]", f"{QKV0}[v]"]
    assert report["state"] == "poisoned"
    # The incomplete module was never processed: its live weight is still exactly A's.
    after = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0]
    assert torch.equal(after[QKV0], before[QKV0])


def test_gap2_duplicated_q_is_refused_and_named(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    engine = engine_at_a
    tensors = load_tensors(dense["b"])
    q = "model.layers.0.self_attn.q_proj.weight"
    v = "model.layers.0.self_attn.v_proj.weight"
    first = write_tensors(
        tmp_path / "first.safetensors", {k: t for k, t in tensors.items() if k != v}
    )
    again = write_tensors(tmp_path / "again.safetensors", {q: tensors[q]})
    assert _only(engine.rpc("weightroll_begin", {"updateId": "dup", "version": "b"}))["ok"]
    assert _only(engine.rpc("weightroll_load", {"path": str(first)}))["ok"]
    dup = _only(engine.rpc("weightroll_load", {"path": str(again)}))
    assert not dup["ok"] and dup["error"]["code"] == "duplicate_shard"
    assert f"{QKV0}[q]" in dup["error"]["message"]
    assert dup["duplicates"] == [f"{QKV0}[q]"] and f"{QKV0}[v]" in dup["missing"]
    assert dup["state"] == "poisoned"


def test_partial_update_of_one_mlp_leaves_everything_else_bit_identical(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    engine = engine_at_a
    before = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0]
    mlp = write_subset(dense["b"], tmp_path / "mlp.safetensors", lambda n: ".layers.1.mlp." in n)
    report = _only(
        engine.update(
            "mlp1", "a-mlp1", mlp, mode="partial", scope=["model.layers.1.mlp."], baseVersion="a"
        )
    )
    assert report["ok"] and report["required"] == 3 and report["version"] == "a-mlp1", report
    after = engine.llm.collective_rpc("probe_dense_weights", args=("{}",))[0]
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    assert changed == [
        "model.layers.1.mlp.down_proj.weight",
        "model.layers.1.mlp.gate_up_proj.weight",
    ]


def test_partial_update_must_cover_every_shard_of_a_touched_module(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    engine = engine_at_a
    gate_only = write_subset(
        dense["b"],
        tmp_path / "gate.safetensors",
        lambda n: n == "model.layers.1.mlp.gate_proj.weight",
    )
    report = _only(
        engine.update(
            "gate",
            "a-gate",
            gate_only,
            mode="partial",
            scope=["model.layers.1.mlp.gate_proj.weight"],
            baseVersion="a",
        )
    )
    assert not report["ok"]
    assert report["missing"] == ["model.layers.1.mlp.gate_up_proj.weight[1]"]
    assert report["state"] == "clean" and report["version"] == "a", "nothing live was written"


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("unknown_name", "unknown_tensor"),
        ("wrong_shape", "shape_mismatch"),
        ("wrong_dtype", "shape_mismatch"),
        ("missing_file", "source_unavailable"),
        ("truncated_file", "source_unavailable"),
        ("not_safetensors", "source_unavailable"),
        ("out_of_scope", "unknown_tensor"),
        ("repeated_patch_index", "invalid_request"),
    ],
)
def test_bad_input_is_refused_without_touching_the_engine(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path, case: str, code: str
) -> None:
    engine = engine_at_a
    tensors = load_tensors(dense["b"])
    down = "model.layers.0.mlp.down_proj.weight"
    spec: dict[str, Any] = {}
    if case == "unknown_name":
        path = write_tensors(
            tmp_path / "x.safetensors",
            {**tensors, "model.layers.9.foo.weight": tensors[down].clone()},
        )
    elif case == "wrong_shape":
        path = write_tensors(
            tmp_path / "x.safetensors", {**tensors, down: tensors[down].t().contiguous()}
        )
    elif case == "wrong_dtype":
        path = write_tensors(
            tmp_path / "x.safetensors", {**tensors, down: tensors[down].to(torch.int32)}
        )
    elif case == "missing_file":
        path = tmp_path / "nope.safetensors"
    elif case == "truncated_file":
        full = write_tensors(tmp_path / "full.safetensors", tensors)
        path = tmp_path / "cut.safetensors"
        path.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    elif case == "not_safetensors":
        path = tmp_path / "junk.safetensors"
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    elif case == "repeated_patch_index":
        norm = "model.norm.weight"  # a module sparse patches may write (no packed copy)
        shape = tuple(tensors[norm].shape)
        indices = torch.tensor([3, 5, 3])
        values = torch.ones(3, dtype=tensors[norm].dtype)
        path = write_patch(tmp_path / "x.patch.safetensors", "a", {norm: (shape, indices, values)})
        spec = {"mode": "sparse", "baseVersion": "a"}
    else:
        path = write_tensors(tmp_path / "x.safetensors", {down: tensors[down]})
        spec = {"mode": "partial", "scope": ["model.layers.1.mlp."], "baseVersion": "a"}
    report = _only(engine.update(f"bad-{case.replace('_', '-')}", "b", path, **spec))
    assert not report["ok"] and report["error"]["code"] == code, report
    assert report["error"]["message"]
    assert report["state"] == "clean" and report["version"] == "a", "a refused batch writes nothing"
    assert engine.outputs() == engine.boot_outputs  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("method", "payload", "code"),
    [
        ("weightroll_load", {"path": "/x"}, "wrong_state"),
        ("weightroll_finish", {}, "wrong_state"),
        ("weightroll_begin", {"updateId": "Bad Id", "version": "b"}, "invalid_request"),
        ("weightroll_begin", {"updateId": "x", "version": "b", "typo": 1}, "invalid_request"),
        (
            "weightroll_begin",
            {"updateId": "x", "version": "b", "mode": "sparse"},
            "invalid_request",
        ),
        (
            "weightroll_begin",
            {"updateId": "x", "version": "b", "mode": "sparse", "baseVersion": "z"},
            "wrong_state",
        ),
    ],
)
def test_calls_in_the_wrong_state_or_malformed_are_structured_errors(
    engine_at_a: Engine, method: str, payload: dict[str, Any], code: str
) -> None:
    report = _only(engine_at_a.rpc(method, payload))
    assert not report["ok"] and report["error"]["code"] == code, report
    assert report["state"] == "clean" and report["version"] == "a"


def test_second_begin_while_a_session_is_open_is_a_conflict(engine_at_a: Engine) -> None:
    engine = engine_at_a
    assert _only(engine.rpc("weightroll_begin", {"updateId": "one", "version": "b"}))["ok"]
    again = _only(engine.rpc("weightroll_begin", {"updateId": "one", "version": "b"}))
    assert again["ok"], "re-begin of the same untouched session is idempotent"
    other = _only(engine.rpc("weightroll_begin", {"updateId": "two", "version": "b"}))
    assert not other["ok"] and other["error"]["code"] == "update_conflict"
    assert "one" in other["error"]["message"]
    engine.rpc("weightroll_abort")


def test_manifest_is_checked_before_any_live_byte(
    engine_at_a: Engine, dense: dict[str, Any], tmp_path: Path
) -> None:
    from engine_agent.manifest import build_manifest, write_manifest

    engine = engine_at_a
    manifest = tmp_path / "b.manifest.json"
    write_manifest(build_manifest(dense["b"], version="b"), manifest)
    wrong = tmp_path / "a.manifest.json"
    write_manifest(build_manifest(dense["a"], version="a"), wrong)

    assert _only(engine.rpc("weightroll_begin", {"updateId": "mf-bad", "version": "b"}))["ok"]
    bad = _only(engine.rpc("weightroll_load", {"path": str(dense["b"]), "manifest": str(wrong)}))
    assert not bad["ok"] and bad["error"]["code"] == "manifest_mismatch", bad
    assert bad["state"] == "clean" and bad["version"] == "a", "checked before anything was written"

    assert _only(engine.rpc("weightroll_begin", {"updateId": "mf-good", "version": "b"}))["ok"]
    good = _only(
        engine.rpc("weightroll_load", {"path": str(dense["b"]), "manifest": str(manifest)})
    )
    assert good["ok"], good
    assert _only(engine.rpc("weightroll_finish"))["ok"]
