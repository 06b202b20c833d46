"""Table-driven tests of the all-rank rules: counting the answers (``engine_agent.sidecar.rounds``)
and judging them (``engine_agent.sidecar.agreement``)."""

from __future__ import annotations

from typing import Any

import pytest

from engine_agent.protocol import EngineState
from engine_agent.sidecar.agreement import EMPTY_COVERAGE_HASH, check_commit, check_session
from engine_agent.sidecar.rounds import collect_reports, collect_states, worst_state


def report(tp: int = 0, dp: int = 0, pp: int = 0, ep: int = 0, **fields: Any) -> dict[str, Any]:
    """A finish report of a rank that committed ``v2`` in update ``u-1``."""
    base: dict[str, Any] = {
        "rank": {"dp": dp, "pp": pp, "tp": tp, "ep": ep},
        "call": "finish",
        "ok": True,
        "state": "clean",
        "version": "v2",
        "updateId": "u-1",
        "required": 10,
        "received": 10,
        "coverageHash": "cov",
        "digest": f"digest-tp{tp}",
        "sourceDigest": "checkpoint-b",
    }
    base.update(fields)
    return base


def codes(results: list[Any], world: int = 2) -> list[str]:
    round_ = check_commit(collect_reports("weightroll_finish", results, world), "u-1", "v2")
    return [problem.code for problem in round_.problems]


@pytest.mark.parametrize(
    ("results", "world", "expected"),
    [
        ([report(0), report(1)], 2, []),
        ([report(0)], 2, ["rank_missing"]),
        ([], 1, ["rank_missing"]),
        ([report(0), report(0)], 2, ["rank_duplicate"]),
        ([report(0), report(1), report(2)], 2, ["rank_unexpected"]),
        ([report(0), {"bogus": 1}], 2, ["rank_malformed"]),
        ([report(0), None], 2, ["rank_malformed"]),
        ([report(0), "Traceback ..."], 2, ["rank_malformed"]),
        (
            [report(0), report(1, ok=False, error={"code": "coverage_incomplete", "message": "x"})],
            2,
            ["coverage_incomplete"],
        ),
        (
            [report(0), report(1, ok=False, error={"code": "weird", "message": "x"})],
            2,
            ["rank_error"],
        ),
        ([report(0), report(1, updateId="u-9")], 2, ["update_id_mismatch"]),
        ([report(0), report(1, version="v1")], 2, ["version_mismatch"]),
        ([report(0), report(1, state="poisoned")], 2, ["not_committed"]),
        ([report(0), report(1, coverageHash="other")], 2, ["coverage_hash_mismatch"]),
        ([report(0), report(1, coverageHash="")], 2, ["coverage_hash_missing"]),
        ([report(0), report(1, received=0)], 2, ["coverage_empty"]),
        ([report(0), report(1, digest="")], 2, ["digest_missing"]),
        (
            [report(0), report(1, missing=["layers.0.qkv:k"], missingCount=3)],
            2,
            ["coverage_incomplete"],
        ),
        ([report(0), report(1, duplicates=["layers.0.qkv:q"])], 2, ["duplicate_shard"]),
        ([report(0), report(1, identityOk=False)], 2, ["identity_changed"]),
        ([report(0), report(1, identityProblems=["ptr moved"])], 2, ["identity_changed"]),
        # Data-parallel replicas of the same shard must hold the same bytes.
        ([report(0, dp=0), report(0, dp=1)], 2, []),
        ([report(0, dp=0), report(0, dp=1, digest="different")], 2, ["digest_mismatch"]),
    ],
    ids=lambda value: None if isinstance(value, list | int) else str(value),
)
def test_commit_rules(results: list[Any], world: int, expected: list[str]) -> None:
    assert codes(results, world) == expected


# Rule 5 coverage grouping: ranks are compared only within one (pp, ep) group, i.e. with the
# ranks that differ from them only in tp/dp and so must hold the same shard keys.
@pytest.mark.parametrize(
    ("results", "expected"),
    [
        pytest.param(
            [report(0), report(1, coverageHash="other")],
            ["coverage_hash_mismatch"],
            id="tp2-mismatch-fails",
        ),
        pytest.param(
            [report(0, pp=0, coverageHash="stage0"), report(0, pp=1, coverageHash="stage1")],
            [],
            id="pp2-stages-differ-passes",
        ),
        pytest.param(
            [
                report(0, pp=0, coverageHash="stage0"),
                report(1, pp=0, coverageHash="stage0"),
                report(0, pp=1, coverageHash="stage1"),
                report(1, pp=1, coverageHash="stage1"),
            ],
            [],
            id="pp2-tp2-equal-within-stage-passes",
        ),
        pytest.param(
            [
                report(0, pp=0, coverageHash="stage0"),
                report(1, pp=0, coverageHash="stage0"),
                report(0, pp=1, coverageHash="stage1"),
                report(1, pp=1, coverageHash="other"),
            ],
            ["coverage_hash_mismatch"],
            id="pp2-tp2-same-stage-disagrees-fails",
        ),
        pytest.param(
            [report(0, ep=0, coverageHash="e0-e1"), report(1, ep=1, coverageHash="e2-e3")],
            [],
            id="ep2-different-experts-passes",
        ),
        pytest.param(
            [
                report(0, dp=0, ep=0, coverageHash="e0-e1"),
                report(0, dp=1, ep=1, coverageHash="e2-e3", digest="digest-ep1"),
            ],
            [],
            id="ep-across-dp-different-experts-and-bytes-passes",
        ),
        pytest.param(
            [report(0, ep=0, coverageHash="e0-e1"), report(1, ep=0, coverageHash="e2-e3")],
            ["coverage_hash_mismatch"],
            id="experts-differ-without-ep-rank-fails",
        ),
        pytest.param(
            [report(0, pp=0), report(0, pp=1, coverageHash="")],
            ["coverage_hash_missing"],
            id="pp-stage-without-hash-fails",
        ),
        pytest.param(
            [report(0, pp=0), report(0, pp=1, coverageHash=EMPTY_COVERAGE_HASH)],
            ["coverage_empty"],
            id="pp-stage-with-empty-set-fails",
        ),
        pytest.param(
            [report(0, ep=0), report(1, ep=1, received=0)],
            ["coverage_empty"],
            id="ep-rank-received-nothing-fails",
        ),
        pytest.param(
            [
                report(0, coverageHash=EMPTY_COVERAGE_HASH),
                report(1, coverageHash=EMPTY_COVERAGE_HASH),
            ],
            ["coverage_empty"],
            id="tp-ranks-agreeing-on-empty-set-fail",
        ),
        pytest.param(
            [report(0, pp=0), report(0, pp=1, missing=["lm_head.weight"], missingCount=1)],
            ["coverage_incomplete"],
            id="pp-stage-incomplete-fails",
        ),
        pytest.param(
            [report(0, ep=0), report(1, ep=1, duplicates=["x.w2_weight[e2:w2]"])],
            ["duplicate_shard"],
            id="ep-rank-duplicate-fails",
        ),
    ],
)
def test_coverage_is_compared_within_pp_ep_groups(results: list[Any], expected: list[str]) -> None:
    assert codes(results, len(results)) == expected


# Rule 5 source part: every rank is handed every tensor of the source (TP, PP and EP alike), so
# every rank of one replica reports the same source digest; ``digest`` may differ beyond dp only
# by the ``live:`` slices of a sparse update.
@pytest.mark.parametrize(
    ("results", "expected"),
    [
        pytest.param(
            [report(0, sourceDigest="checkpoint-b"), report(1, sourceDigest="checkpoint-c")],
            ["digest_mismatch"],
            id="tp2-ranks-read-different-checkpoints-fails",
        ),
        pytest.param(
            [report(0, digest="live-tp0"), report(1, digest="live-tp1")],
            [],
            id="tp2-sparse-live-slices-differ-one-checkpoint-passes",
        ),
        pytest.param(
            [
                report(0, pp=0, coverageHash="stage0", digest="d"),
                report(0, pp=1, coverageHash="stage1", digest="d"),
            ],
            [],
            id="pp2-stages-own-different-layers-one-checkpoint-passes",
        ),
        pytest.param(
            [
                report(0, pp=0, coverageHash="stage0"),
                report(0, pp=1, coverageHash="stage1", sourceDigest="checkpoint-c"),
            ],
            ["digest_mismatch"],
            id="pp2-stages-read-different-checkpoints-fails",
        ),
        pytest.param(
            [
                report(0, ep=0, coverageHash="e0-e1", digest="d"),
                report(1, ep=1, coverageHash="e2-e3", digest="d"),
            ],
            [],
            id="ep2-ranks-own-different-experts-one-checkpoint-passes",
        ),
        pytest.param(
            [
                report(0, ep=0, coverageHash="e0-e1"),
                report(1, ep=1, coverageHash="e2-e3", sourceDigest="checkpoint-c"),
            ],
            ["digest_mismatch"],
            id="ep2-ranks-read-different-checkpoints-fails",
        ),
        pytest.param(
            [report(0, dp=0), report(0, dp=1, digest="other", sourceDigest="checkpoint-c")],
            ["digest_mismatch"],
            id="dp2-copies-read-different-checkpoints-fail-once",
        ),
        pytest.param(
            [report(0), report(1, sourceDigest="")],
            ["digest_missing"],
            id="tp-rank-without-source-digest-fails",
        ),
    ],
)
def test_every_rank_of_a_replica_read_one_checkpoint(
    results: list[Any], expected: list[str]
) -> None:
    assert codes(results, len(results)) == expected


def test_a_source_split_names_the_ranks_on_each_side() -> None:
    results = [
        report(tp, sourceDigest="checkpoint-c" if tp == 3 else "checkpoint-b") for tp in range(4)
    ]
    round_ = check_commit(collect_reports("weightroll_finish", results, 4), "u-1", "v2")
    assert [str(p) for p in round_.problems] == [
        "digest_mismatch: ranks of this replica read 2 different checkpoints (the source changed "
        "between their reads): checkpoint-b on dp0:pp0:tp0:ep0, dp0:pp0:tp1:ep0, "
        "dp0:pp0:tp2:ep0; checkpoint-c on dp0:pp0:tp3:ep0"
    ]


def test_ranks_that_do_not_say_which_checkpoint_they_read_are_refused() -> None:
    """Reports in the shape main accepted: TP ranks with different digests and no source digest.

    Nothing in them shows that the two ranks read one checkpoint, so the commit fails closed.
    """
    results = [report(0, digest="checkpoint-b"), report(1, digest="checkpoint-c")]
    for result in results:
        del result["sourceDigest"]
    assert codes(results) == ["digest_missing"]


def test_coverage_mismatch_names_only_the_disagreeing_group() -> None:
    round_ = check_commit(
        collect_reports(
            "weightroll_finish",
            [
                report(0, pp=0, coverageHash="aaa"),
                report(1, pp=0, coverageHash="aaa"),
                report(0, pp=1, coverageHash="bbb"),
                report(1, pp=1, coverageHash="zzz"),
            ],
            4,
        ),
        "u-1",
        "v2",
    )
    assert [str(p) for p in round_.problems] == [
        "coverage_hash_mismatch: ranks of the same pipeline stage and expert rank disagree on "
        "the plan: dp0:pp1:tp0:ep0=bbb, dp0:pp1:tp1:ep0=zzz"
    ]


def test_problem_messages_name_ranks_and_values() -> None:
    round_ = check_commit(
        collect_reports(
            "weightroll_finish",
            [report(0), report(1, missing=["a", "b"], missingCount=2, coverageHash="zzz")],
            2,
        ),
        "u-1",
        "v2",
    )
    text = "\n".join(map(str, round_.problems))
    assert "rank dp0:pp0:tp1:ep0 is missing 2 shard(s): a, b" in text
    assert "dp0:pp0:tp1:ep0=zzz" in text


def test_many_failed_ranks_are_summarised() -> None:
    results = [
        report(tp, ok=False, error={"code": "source_unavailable", "message": "gone"})
        for tp in range(12)
    ]
    round_ = collect_reports("weightroll_load", results, 12)
    assert len(round_.problems) == 9
    assert str(round_.problems[-1]) == "rank_error: weightroll_load failed on 4 more ranks"


def test_session_check_ignores_version_but_not_id() -> None:
    round_ = collect_reports("weightroll_begin", [report(0, version="v1", state="open")], 1)
    assert check_session(round_, "u-1").ok
    assert not check_session(round_, "u-2").ok


def status(tp: int, state: str = "clean", version: str = "v1") -> dict[str, Any]:
    return {
        "rank": {"dp": 0, "pp": 0, "tp": tp},
        "state": state,
        "version": version,
        "servingSafe": state == "clean",
    }


@pytest.mark.parametrize(
    ("results", "expected_state", "expected_codes"),
    [
        ([status(0), status(1)], EngineState.CLEAN, []),
        ([status(0), status(1, "poisoned")], EngineState.POISONED, ["state_mismatch"]),
        ([status(0, "dirty"), status(1, "dirty")], EngineState.DIRTY, []),
        ([status(0), status(1, version="v2")], EngineState.CLEAN, ["version_mismatch"]),
        ([status(0)], EngineState.CLEAN, ["rank_missing"]),
    ],
)
def test_state_rules(
    results: list[Any], expected_state: EngineState, expected_codes: list[str]
) -> None:
    round_ = collect_states(results, 2)
    assert round_.state is expected_state
    assert [problem.code for problem in round_.problems] == expected_codes


def test_worst_state_orders_by_severity() -> None:
    assert worst_state([]) is None
    assert worst_state([EngineState.OPEN, EngineState.CLEAN]) is EngineState.OPEN
    assert worst_state([EngineState.DIRTY, EngineState.POISONED]) is EngineState.POISONED


def test_with_a_manifest_every_rank_digest_must_be_the_manifests() -> None:
    from engine_agent.sidecar.agreement import check_commit
    from engine_agent.sidecar.rounds import collect_reports

    reports = [report(0, dp=0, digest="m"), report(0, dp=1, digest="m")]
    round_ = collect_reports("weightroll_finish", reports, 2)
    assert check_commit(round_, "u-1", "v2", expected_digest="m").ok
    wrong = check_commit(round_, "u-1", "v2", expected_digest="other")
    assert [p.code for p in wrong.problems] == ["digest_manifest_mismatch"]


def test_the_data_parallel_rank_comes_from_vllm_032s_parallel_config() -> None:
    """vLLM 0.32 has no get_data_parallel_rank: without the config every replica was dp0, two
    replicas collided as rank_duplicate and the cross-replica digest comparison never ran."""
    pytest.importorskip("vllm")
    from vllm.config import ParallelConfig

    from engine_agent.reload.registry import rank_id
    from engine_agent.sidecar.agreement import check_commit
    from engine_agent.sidecar.rounds import collect_reports

    ranks = [
        rank_id(parallel_config=ParallelConfig(data_parallel_size=2, data_parallel_rank=dp))
        for dp in (0, 1)
    ]
    assert [rank.dp for rank in ranks] == [0, 1]
    reports = [report(0, dp=rank.dp, digest=f"bytes-{rank.dp}") for rank in ranks]
    verdict = check_commit(collect_reports("weightroll_finish", reports, 2), "u-1", "v2")
    assert [p.code for p in verdict.problems] == ["digest_mismatch"]
