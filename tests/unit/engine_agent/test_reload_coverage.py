"""Table-driven tests of the per-shard coverage ledger (gap 2) and identity comparison."""

from __future__ import annotations

import pytest

from engine_agent.errors import CoverageIncomplete, DuplicateShard, UnknownTensor
from engine_agent.reload.coverage import CoverageLedger, ShardKey, coverage_hash
from engine_agent.reload.identity import StorageRecord, compare_kernels, compare_storage

QKV = "model.layers.0.self_attn.qkv_proj"
EXPERTS = "model.layers.0.mlp.experts"


def qkv(shard: str) -> ShardKey:
    return ShardKey(QKV, "weight", shard)


def ledger() -> CoverageLedger:
    return CoverageLedger(
        {
            QKV: frozenset(qkv(s) for s in "qkv"),
            EXPERTS: frozenset(
                ShardKey(EXPERTS, "w13_weight", f"e{e}:{w}") for e in (0, 1) for w in ("w1", "w3")
            ),
            "model.norm": frozenset({ShardKey("model.norm", "weight")}),
        }
    )


@pytest.mark.parametrize(
    ("arrived", "complete", "missing"),
    [
        ([], False, ["q", "k", "v"]),
        (["q"], False, ["k", "v"]),  # q alone: same element count as nothing, never complete
        (["q", "k"], False, ["v"]),
        (["q", "k", "v"], True, []),
        (["v", "k", "q"], True, []),  # order does not matter
    ],
)
def test_fused_module_completes_only_with_every_shard(
    arrived: list[str], complete: bool, missing: list[str]
) -> None:
    book = ledger()
    for shard in arrived:
        book.check([qkv(shard)])
        book.record(qkv(shard))
    assert book.is_complete(QKV) is complete
    assert [k.shard for k in book.missing([QKV])] == sorted(missing)


def test_duplicate_shard_is_refused_and_never_advances_completion() -> None:
    book = ledger()
    for shard in "qk":
        book.record(qkv(shard))
    with pytest.raises(DuplicateShard, match=r"qkv_proj.weight\[q\]"):
        book.check([qkv("q")])
    assert not book.is_complete(QKV)
    with pytest.raises(CoverageIncomplete) as info:
        book.require_complete()
    message = str(info.value)
    assert "qkv_proj.weight[v]" in message and "duplicate shard(s) refused" in message


def test_duplicate_within_one_batch_is_refused() -> None:
    with pytest.raises(DuplicateShard):
        ledger().check([qkv("q"), qkv("q")])


def test_expert_shards_are_keyed_per_expert_and_projection() -> None:
    book = ledger()
    for key in [ShardKey(EXPERTS, "w13_weight", s) for s in ("e0:w1", "e0:w3", "e1:w1")]:
        book.record(key)
    assert [str(k) for k in book.missing([EXPERTS])] == [f"{EXPERTS}.w13_weight[e1:w3]"]


def test_unknown_and_optional_keys() -> None:
    book = CoverageLedger({QKV: frozenset({qkv("q")})}, optional=frozenset({("attn", "k_scale")}))
    with pytest.raises(UnknownTensor):
        book.check([ShardKey("elsewhere", "weight")])
    book.check([ShardKey("attn", "k_scale")])
    assert book.in_scope("attn") and book.in_scope(QKV) and not book.in_scope("elsewhere")


def test_coverage_hash_is_order_independent_and_set_sensitive() -> None:
    keys = [qkv(s) for s in "qkv"]
    assert coverage_hash(keys) == coverage_hash(reversed(keys))
    assert coverage_hash(keys) != coverage_hash(keys[:2])


def test_storage_and_kernel_comparison_name_every_change() -> None:
    rec = StorageRecord(0x1000, 0, (4, 4), (4, 1), "bfloat16")
    moved = StorageRecord(0x2000, 0, (4, 4), (4, 1), "bfloat16")
    problems = compare_storage({"a": rec, "b": rec}, {"a": moved, "c": rec})
    assert len(problems) == 3
    assert problems[0].startswith("a: storage changed")
    assert "disappeared" in problems[1] and "appeared" in problems[2]
    assert compare_storage({"a": rec}, {"a": rec}) == []
    assert compare_kernels({"m": "qm=X"}, {"m": "qm=Y"}) == ["m: kernel changed 'qm=X' -> 'qm=Y'"]
