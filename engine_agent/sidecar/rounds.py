"""The ranks' answers, counted: raw ``collective_rpc`` results parsed into per-rank rounds.

A ``collective_rpc`` that returned is not proof that every rank did what was asked (vLLM
#60928: an exception on a non-output rank can be logged and dropped). So the agent never looks at
"the" result; it runs every per-rank list through these functions, which return the parsed
reports plus a list of :class:`Problem` values. No problem means the ranks answered as asked;
any problem fails the update closed (engine-reload.md R7). What the answers must then agree on
to commit is :mod:`engine_agent.sidecar.agreement`.

Rules, in the order they are checked:
    1. Every result validates as the expected model (:class:`RankReport` / :class:`RankStatus`).
    2. Exactly ``world_size`` results, each from a distinct rank (``dp:pp:tp:ep``); a missing
       result or a repeated rank key is a failure even if every present rank said ``ok``.
    3. Every rank reports ``ok`` (its error is quoted).

The module is pure: no I/O, no clock; table-driven tests cover every rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from pydantic import ValidationError

from engine_agent.protocol import EngineState, RankReport, RankStatus

__all__ = [
    "MAX_NAMED",
    "Problem",
    "RankRound",
    "StateRound",
    "collect_reports",
    "collect_states",
    "names",
    "worst_state",
]

#: How many ranks a problem message names before it says "and N more".
MAX_NAMED: Final = 8

_SEVERITY: Final[dict[EngineState, int]] = {
    EngineState.CLEAN: 0,
    EngineState.OPEN: 1,
    EngineState.DIRTY: 2,
    EngineState.POISONED: 3,
}


@dataclass(frozen=True, slots=True)
class Problem:
    """One reason not to commit (or not to be ready)."""

    #: Short machine-readable reason; also the ``reason`` label of the failure metric.
    code: str
    #: Human message naming the ranks and values involved.
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True, slots=True)
class RankRound:
    """The per-rank answers to one extension call and what is wrong with them."""

    call: str
    reports: tuple[RankReport, ...]
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True, slots=True)
class StateRound:
    """The per-rank answers to ``weightroll_state`` and what is wrong with them."""

    statuses: tuple[RankStatus, ...]
    problems: tuple[Problem, ...]

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def state(self) -> EngineState | None:
        """The worst state any rank reports (``None`` when no rank answered)."""
        return worst_state(status.state for status in self.statuses)

    @property
    def versions(self) -> set[str]:
        return {status.version for status in self.statuses}


def worst_state(states: Iterable[EngineState]) -> EngineState | None:
    """Return the most severe state (poisoned > dirty > open > clean), ``None`` if empty."""
    found = list(states)
    return max(found, key=_SEVERITY.__getitem__) if found else None


def names(keys: Sequence[str]) -> str:
    """``keys`` joined for a message, at most :data:`MAX_NAMED` of them."""
    shown = ", ".join(keys[:MAX_NAMED])
    return shown if len(keys) <= MAX_NAMED else f"{shown} and {len(keys) - MAX_NAMED} more"


_M = TypeVar("_M", RankReport, RankStatus)


def _parse(
    model: type[_M], call: str, results: Sequence[Any], world_size: int
) -> tuple[list[_M], list[Problem]]:
    parsed: list[_M] = []
    problems: list[Problem] = []
    for index, raw in enumerate(results):
        try:
            parsed.append(model.model_validate(raw))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "<root>"
            problems.append(
                Problem(
                    "rank_malformed",
                    f"{call}: result #{index} is not a valid {model.__name__} "
                    f"({where}: {first['msg']}): {str(raw)[:200]}",
                )
            )
    seen: dict[str, int] = {}
    for item in parsed:
        seen[item.rank.key] = seen.get(item.rank.key, 0) + 1
    duplicated = sorted(key for key, count in seen.items() if count > 1)
    if duplicated:
        problems.append(
            Problem("rank_duplicate", f"{call}: more than one result from {names(duplicated)}")
        )
    if len(results) < world_size:
        problems.append(
            Problem(
                "rank_missing",
                f"{call}: {len(results)} of {world_size} ranks answered "
                f"(answered: {names(sorted(seen)) or 'none'})",
            )
        )
    elif len(results) > world_size:
        problems.append(
            Problem(
                "rank_unexpected",
                f"{call}: {len(results)} results for a world size of {world_size}",
            )
        )
    return parsed, problems


def collect_reports(call: str, results: Sequence[Any], world_size: int) -> RankRound:
    """Parse the results of a begin/load/finish/abort call and apply rules 1-3.

    Args:
        call: the extension method, for messages (e.g. ``"weightroll_load"``).
        results: the raw ``results`` list of ``collective_rpc``.
        world_size: TP·PP·DP as reported by ``/get_world_size`` before the update.
    """
    reports, problems = _parse(RankReport, call, results, world_size)
    failed = [report for report in reports if not report.ok]
    for report in failed[:MAX_NAMED]:
        error = report.error
        detail = f"{error.code}: {error.message}" if error else "no error given"
        if error and error.field:
            detail += f" (field {error.field})"
        code = error.code if error and error.code in _PASSTHROUGH_CODES else "rank_error"
        problems.append(Problem(code, f"{call} failed on rank {report.rank.key}: {detail}"))
    if len(failed) > MAX_NAMED:
        problems.append(
            Problem("rank_error", f"{call} failed on {len(failed) - MAX_NAMED} more ranks")
        )
    return RankRound(call, tuple(reports), tuple(problems))


#: Rank error codes kept as the problem code (bounded set: they become metric labels).
_PASSTHROUGH_CODES: Final = frozenset(
    {
        # engine_agent.errors codes, raised inside the ranks
        "invalid_request",
        "wrong_state",
        "update_conflict",
        "source_unavailable",
        "manifest_mismatch",
        "unknown_tensor",
        "shape_mismatch",
        "duplicate_shard",
        "coverage_incomplete",
        "identity_changed",
        "sparse_refused",
        "derived_state_unsupported",
        "prefetch_memory",
        # engine_agent.manifest
        "manifest_invalid",
    }
)


def collect_states(results: Sequence[Any], world_size: int) -> StateRound:
    """Parse the results of ``weightroll_state`` (rules 1-2) and check they agree.

    Agreement here means one state and one version on every rank; an open, dirty or poisoned
    rank is reported by :attr:`StateRound.state`, not as a problem, so callers decide.
    """
    statuses, problems = _parse(RankStatus, "weightroll_state", results, world_size)
    versions = sorted({status.version for status in statuses})
    if len(versions) > 1:
        detail = sorted(f"{status.rank.key}={status.version!r}" for status in statuses)
        problems.append(
            Problem("version_mismatch", f"ranks serve different versions: {names(detail)}")
        )
    states = sorted({status.state.value for status in statuses})
    if len(states) > 1:
        detail = sorted(f"{status.rank.key}={status.state.value}" for status in statuses)
        problems.append(Problem("state_mismatch", f"ranks disagree on state: {names(detail)}"))
    return StateRound(tuple(statuses), tuple(problems))
