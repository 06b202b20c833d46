"""How a trainer push fails: the HTTP answer the trainer gets, why a push nobody can finish is
ended, and the fence that closes a failed push on every rank.

* :class:`PushFailed` carries the status and the problems (the trainer's
  :class:`~engine_agent.protocol.ErrorBody`); :func:`status_of` maps an engine error to it
  (502 vLLM refused, 504 timed out, 503 unreachable, 422 a rank raised).
* :func:`why_dead`: the agent's guard ends a push whose trainer stopped calling (idle past
  ``--push-idle-timeout``) or whose session the ranks no longer hold (vLLM restarted); only
  positive evidence counts, so a vLLM that cannot answer now is asked again on the next pass.
* :func:`fence_ranks`: ``weightroll_transfer_fence`` on every rank, each of which must answer
  poisoned; what did not is returned as ``fence_failed``, never raised (fail closed).
"""

from __future__ import annotations

import json
from typing import Final

from engine_agent.protocol import EngineState, ExtensionRpc
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineError, EngineRejected, EngineTimeout, VllmClient
from engine_agent.sidecar.rounds import Problem, collect_reports, collect_states

__all__ = [
    "FENCE",
    "PushFailed",
    "fence_ranks",
    "status_of",
    "status_of_problems",
    "why_dead",
]

FENCE: Final = ExtensionRpc.TRANSFER_FENCE

_IN_SESSION: Final = frozenset({EngineState.OPEN, EngineState.DIRTY})


class PushFailed(Exception):
    """A push step failed; ``status`` is the HTTP status the trainer gets."""

    def __init__(self, status: int, problems: list[Problem], field: str | None = None) -> None:
        super().__init__("; ".join(map(str, problems)))
        self.status = status
        self.problems = problems
        #: The request field at fault (``ErrorBody.field``), when one is.
        self.field = field


def status_of(error: EngineError) -> int:
    if isinstance(error, EngineRejected):
        return 502
    if isinstance(error, EngineTimeout):
        return 504
    if "unreachable" in str(error):
        return 503
    return 422  # vLLM answered 5xx: a rank raised (its reason is in the body)


def status_of_problems(problems: list[Problem]) -> int:
    if any(
        p.code in ("engine_unavailable", "engine_timeout") and "unreachable" in p.message
        for p in problems
    ):
        return 503
    return 422


async def why_dead(
    client: VllmClient, config: AgentConfig, push_id: str, world: int, idle: float
) -> Problem | None:
    """Why push ``push_id`` (``idle`` seconds since the trainer's last call) can no longer be
    finished by anyone (``None``: it still can, or vLLM could not be asked now)."""
    if idle > config.push_idle_timeout:
        return Problem(
            "push_abandoned",
            f"no trainer call for {idle:.0f}s (push idle timeout "
            f"{config.push_idle_timeout:g}s); the trainer gave up or died mid-push",
        )
    try:
        results = await client.collective_rpc(ExtensionRpc.STATE, "{}", config.control_timeout)
    except EngineError:
        return None  # vLLM may be restarting: look again on the next pass
    # Only positive evidence ends the push: a rank that answers without the push's open
    # session (a disagreement between open and dirty ranks is normal mid-push).
    lost = [
        f"{status.rank.key}: {status.state.value} {status.update_id or 'no session'}"
        for status in collect_states(results, world).statuses
        if status.update_id != push_id or status.state not in _IN_SESSION
    ]
    if lost:
        return Problem(
            "engine_restarted",
            f"the ranks no longer hold push {push_id} ({'; '.join(sorted(lost))}); vLLM was "
            "restarted or the session was closed underneath the push",
        )
    return None


async def fence_ranks(client: VllmClient, timeout: float, world: int, reason: str) -> list[Problem]:
    """Poison every rank for ``reason``; returns what could not be fenced (never raises)."""
    try:
        results = await client.collective_rpc(FENCE, json.dumps({"reason": reason[:500]}), timeout)
        # A 200 is not every rank fenced: each must answer, poisoned.
        fenced = collect_reports(FENCE, results, world)
        unfenced = sorted(
            report.rank.key for report in fenced.reports if report.state is not EngineState.POISONED
        )
        problems = [Problem("fence_failed", str(p)) for p in fenced.problems]
        if unfenced:
            problems.append(Problem("fence_failed", f"{FENCE}: ranks {unfenced} are not poisoned"))
        return problems
    except Exception as e:  # fail closed whatever broke; the error names it
        return [Problem("fence_failed", f"{FENCE}: {e}")]
