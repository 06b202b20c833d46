"""All-rank agreement: may this replica be declared committed?

The per-rank answers, parsed and counted (:mod:`engine_agent.sidecar.rounds`, rules 1-3), must
then agree with one another and with the update; any problem fails the update closed
(engine-reload.md R7).

Rules, in the order they are checked (after rules 1-3 of :mod:`engine_agent.sidecar.rounds`):
    4. Every rank talks about the same update id (and, at commit, the target version).
    5. At commit: every rank is ``clean``, has no missing or duplicate shard against its own
       required set, identity unchanged, a non-empty digest, and a coverage-set hash of a
       non-empty set of received shards; ranks that must hold the same shard keys report the
       same coverage hash; *every* rank reports the same source digest (they all read one
       checkpoint); ranks that differ only in ``dp`` (replicas of the same shard) report the
       same digest; and with a manifest, every digest is the manifest's.

Which ranks must hold the same shard keys (rule 5): those in the same pipeline stage (``pp``)
with the same expert-parallel rank (``ep``), i.e. ranks that differ only in ``tp`` and/or ``dp``.
A TP rank holds its own slice of every module, but the shard *keys* (``qkv_proj.weight[q]``) are
the same on every TP rank. Ranks of different pipeline stages own different layers, and with
expert parallelism each ``ep`` rank owns different experts (``w13_weight[e2:w1]``), so their key
sets, and hashes, differ legitimately and are not compared. What the cross-rank equality
guards against — a rank that planned the wrong or an empty set — is kept per group, plus two
per-rank guards that need no peer: the set must be non-empty (a rank that received nothing, or
whose hash is that of the empty set, fails ``coverage_empty``), and it must be complete against
the rank's own required set (``coverage_incomplete`` / ``duplicate_shard``). A rank whose
``ep`` is wrongly reported as 0 lands in one group with its TP peers and fails closed.

Which ranks must have read the same checkpoint (rule 5): all of them, whatever the layout. The
per-tensor rule — no checkpoint tensor name may have two content hashes across the ranks of a
replica — is what must hold; it reduces to equal source digests because no rank reads a subset:
every rank's loaders are handed every tensor of the source (the same ``names`` on every rank),
each is hashed as it is handed out, and TP slicing, a PP stage's ``PPMissingLayer`` and an EP
rank's expert map drop what the rank does not own only afterwards (a rank whose loaders stop
early fails its load: ``CheckpointSource.complete``). Trainer pushes broadcast every full tensor
to every rank alike. So ``source_digest`` (``rank_digest`` over exactly those content hashes)
is equal on every rank of a replica that read one checkpoint, and two values mean the source
changed between two ranks' reads (a directory swapped during the load, with no manifest to pin
it): each rank is ``clean`` at the target version, but they serve a mix of two checkpoints.
That is ``digest_mismatch``, naming the ranks of each side, and the update fails after finish,
so the agent poisons every rank (the replica fence). ``digest`` itself is compared only across
``dp``: for sparse updates it also covers the patched modules' live tensors, which are each
rank's own slice. Per-tensor hashes are not sent: a checkpoint can hold tens of thousands of
tensors, and with no rank reading a subset, the one digest decides the same question.

The module is pure: no I/O, no clock; table-driven tests cover every rule.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

from engine_agent.protocol import EngineState, RankReport
from engine_agent.sidecar.rounds import Problem, RankRound, StateRound, names

__all__ = ["EMPTY_COVERAGE_HASH", "check_commit", "check_session", "committed_problems"]

#: ``coverage_hash`` of the empty shard set (SHA-256 of no bytes; see reload/coverage.py).
EMPTY_COVERAGE_HASH: Final = hashlib.sha256(b"").hexdigest()


def check_session(round_: RankRound, update_id: str) -> RankRound:
    """Rule 4 for begin/load: every rank that succeeded reports the update id of this session.

    A rank that failed already has a problem naming its error (and a failed load or finish ends
    its session, so it reports no update id); it is not blamed twice.
    """
    wrong = sorted(
        f"{report.rank.key}={report.update_id!r}"
        for report in round_.reports
        if report.ok and report.update_id != update_id
    )
    if not wrong:
        return round_
    problem = Problem(
        "update_id_mismatch",
        f"{round_.call}: ranks report another update than {update_id!r}: {names(wrong)}",
    )
    return RankRound(round_.call, round_.reports, (*round_.problems, problem))


def check_commit(
    round_: RankRound,
    update_id: str,
    version: str,
    manifest_digest: str | None = None,
    *,
    expected_digest: str | None = None,
) -> RankRound:
    """Rules 4-5 for ``weightroll_finish``: may this replica be declared committed?

    With ``manifest_digest``, every rank must also report that it verified its bytes against
    exactly that manifest (a rank that skipped the check, or read another one, fails). With
    ``expected_digest`` (``Manifest.rank_digest()``: every rank reads the whole source), every
    rank's ``digest`` — over the content hashes of the bytes its loaders consumed — must equal
    it: a rank that read fewer, more or other tensors than the manifest lists fails. With or
    without a manifest, every rank's ``source_digest`` must be the same (``digest_mismatch``).
    """
    round_ = check_session(round_, update_id)
    problems = list(round_.problems)
    reports = round_.reports

    def ranks_where(predicate: Any) -> list[str]:
        return sorted(report.rank.key for report in reports if predicate(report))

    not_clean = sorted(
        f"{report.rank.key}={report.state.value}"
        for report in reports
        if report.state is not EngineState.CLEAN
    )
    if not_clean:
        problems.append(Problem("not_committed", f"ranks did not commit: {names(not_clean)}"))
    wrong_version = sorted(
        f"{report.rank.key}={report.version!r}" for report in reports if report.version != version
    )
    if wrong_version:
        problems.append(
            Problem(
                "version_mismatch",
                f"ranks report another version than {version!r}: {names(wrong_version)}",
            )
        )
    for report in reports:
        if report.missing_count or report.missing:
            count = report.missing_count or len(report.missing)
            problems.append(
                Problem(
                    "coverage_incomplete",
                    f"rank {report.rank.key} is missing {count} shard(s): {names(report.missing)}",
                )
            )
        if report.duplicates:
            problems.append(
                Problem(
                    "duplicate_shard",
                    f"rank {report.rank.key} received duplicate shard(s): "
                    f"{names(report.duplicates)}",
                )
            )
        if not report.identity_ok or report.identity_problems:
            problems.append(
                Problem(
                    "identity_changed",
                    f"rank {report.rank.key} storage/kernel identity changed: "
                    f"{names(report.identity_problems) or 'no detail given'}",
                )
            )
    if manifest_digest is not None:
        unverified = ranks_where(lambda report: report.manifest_digest != manifest_digest)
        if unverified:
            problems.append(
                Problem(
                    "manifest_unverified",
                    f"ranks did not verify against manifest {manifest_digest[:12]}: "
                    f"{names(unverified)}",
                )
            )
    no_digest = ranks_where(lambda report: not report.digest or not report.source_digest)
    if no_digest:
        problems.append(
            Problem("digest_missing", f"ranks sent no digest or source digest: {names(no_digest)}")
        )
    if expected_digest is not None:
        off = ranks_where(lambda report: report.digest and report.digest != expected_digest)
        if off:
            problems.append(
                Problem(
                    "digest_manifest_mismatch",
                    f"ranks consumed other bytes than the manifest lists (digest is not "
                    f"{expected_digest[:12]}): {names(off)}",
                )
            )
    problems += _check_coverage(reports)
    source_split = _check_one_source(reports)
    problems += source_split
    replicas: dict[tuple[int, int, int], set[str]] = {}
    for report in reports:
        key = (report.rank.pp, report.rank.tp, report.rank.ep)
        replicas.setdefault(key, set()).add(report.digest)
    split = sorted(
        f"pp{pp}:tp{tp}:ep{ep}" for (pp, tp, ep), digests in replicas.items() if len(digests) > 1
    )
    if split and not source_split:  # ranks that read different sources are blamed once
        problems.append(
            Problem(
                "digest_mismatch",
                f"data-parallel replicas of the same shard hold different bytes: {names(split)}",
            )
        )
    return RankRound(round_.call, reports, tuple(problems))


def _check_one_source(reports: Sequence[RankReport]) -> list[Problem]:
    """Rule 5, source part: every rank of the replica read the same checkpoint bytes.

    A rank without a source digest is ``digest_missing`` already and not compared here.
    """
    sides: dict[str, list[str]] = {}
    for report in reports:
        if report.source_digest:
            sides.setdefault(report.source_digest, []).append(report.rank.key)
    if len(sides) < 2:
        return []
    # Largest side first: the odd ranks out are usually the smaller sides.
    described = "; ".join(
        f"{digest[:12]} on {names(sorted(keys))}"
        for digest, keys in sorted(sides.items(), key=lambda side: (-len(side[1]), side[0]))
    )
    return [
        Problem(
            "digest_mismatch",
            f"ranks of this replica read {len(sides)} different checkpoints (the source "
            f"changed between their reads): {described}",
        )
    ]


def _check_coverage(reports: Sequence[RankReport]) -> list[Problem]:
    """Rule 5, coverage part: non-empty on every rank, equal within each ``(pp, ep)`` group."""
    problems: list[Problem] = []
    no_hash = sorted(report.rank.key for report in reports if not report.coverage_hash)
    if no_hash:
        problems.append(
            Problem("coverage_hash_missing", f"ranks sent no coverage hash: {names(no_hash)}")
        )
    empty = sorted(
        report.rank.key
        for report in reports
        if report.coverage_hash
        and (report.received == 0 or report.coverage_hash == EMPTY_COVERAGE_HASH)
    )
    if empty:
        problems.append(
            Problem("coverage_empty", f"ranks received no shard in this update: {names(empty)}")
        )
    groups: dict[tuple[int, int], list[RankReport]] = {}
    for report in reports:
        if report.coverage_hash:
            groups.setdefault((report.rank.pp, report.rank.ep), []).append(report)
    split: list[str] = []
    for group in sorted(groups):
        members = groups[group]
        if len({member.coverage_hash for member in members}) > 1:
            split.extend(sorted(f"{m.rank.key}={m.coverage_hash[:12]}" for m in members))
    if split:
        problems.append(
            Problem(
                "coverage_hash_mismatch",
                "ranks of the same pipeline stage and expert rank disagree on the plan: "
                + names(split),
            )
        )
    return problems


def committed_problems(after: StateRound, update_id: str, version: str) -> list[Problem]:
    """What is wrong with the ranks' states read right after every rank's finish of
    ``update_id`` reported a commit: each rank must be clean at ``version`` and name
    ``update_id`` as the session that committed what it serves. A rank that reports another
    commit (vLLM restarted between finish and this read, or a worker extension that keeps no
    commit id) is not serving this update's weights."""
    problems = list(after.problems)
    if after.state is not EngineState.CLEAN or after.versions != {version}:
        problems.append(
            Problem(
                "not_committed",
                f"after finish the ranks report {after.state} at {sorted(after.versions)}",
            )
        )
    others = sorted(
        f"{status.rank.key}={status.committed_update_id!r}"
        for status in after.statuses
        if status.committed_update_id != update_id
    )
    if others:
        problems.append(
            Problem(
                "not_committed",
                f"after finish not every rank reports {update_id!r} as the commit it serves "
                f"({names(others)}): vLLM was restarted since, or runs a worker extension "
                "of another weightroll release",
            )
        )
    return problems
