"""The verified session behind every weightroll weight-transfer backend (one rank).

:class:`VerifiedReceiver` is what a backend calls instead of vLLM's layerwise reload. It drives
the rank's one :class:`~engine_agent.reload.RankEngine` (shared with the extension's RPCs through
:func:`engine_agent.reload.registry.rank_engine_for`), so coverage, duplicate refusal, staging and
derived-state refresh are exactly those of a file load — nothing is re-implemented here.

Semantics (trainer-path.md, issue 12 B):
    * ``start`` opens a session: the spec armed by the agent (``weightroll_transfer_arm``), or a
      full update named ``push-<n>`` (``n`` counts starts on this rank, so every rank of a
      replica names it alike).
    * ``feed`` loads one batch of received tensors; a refused batch ends the session.
    * ``finish`` verifies and commits, or raises :class:`TransferRefused` naming what is missing
      or duplicated. Because a failed finish ends the session on the rank, a retried finish (the
      next thing vLLM sends, since it keeps its own flag set) and an empty start/finish both fail:
      there is no session, or one that received nothing.
    * ``poison`` is called by the backends when ``update_weights`` raises for any reason (vLLM
      then drops its session without calling finish): the rank is fenced until a full update.
    * Every report is kept in :attr:`last` for the agent (``weightroll_transfer_report``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import torch

from engine_agent.protocol import RankReport, UpdateMode, UpdateSpec
from engine_agent.reload.registry import rank_engine_for

__all__ = ["TransferRefused", "VerifiedReceiver", "describe"]

logger = logging.getLogger(__name__)


class TransferRefused(RuntimeError):
    """A rank refused a step of the update; the message names the reason (shards, code)."""


def describe(report: dict[str, Any]) -> str:
    """One line naming why a rank report is not ``ok``: code, message, missing, duplicates."""
    parsed = RankReport.model_validate(report)
    error = parsed.error
    parts = [f"{error.code}: {error.message}" if error else f"{parsed.call} failed"]
    if parsed.missing:
        more = parsed.missing_count - len(parsed.missing)
        parts.append(
            "missing " + ", ".join(parsed.missing[:8]) + (f" and {more} more" if more > 0 else "")
        )
    if parsed.duplicates:
        parts.append("duplicate " + ", ".join(parsed.duplicates[:8]))
    return f"rank {parsed.rank.key}: " + "; ".join(parts)


class VerifiedReceiver:
    """The verified-session side of one backend instance (one rank, the main model).

    Args:
        model: the rank's model, as vLLM hands it to the backend.
        vllm_config: the engine's config.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self.model = model
        self.vllm_config = vllm_config
        self._armed: UpdateSpec | None = None
        self._starts = 0
        #: The last report of this rank (begin, load, finish, abort), for the agent.
        self.last: dict[str, Any] | None = None

    @property
    def engine(self) -> Any:
        return rank_engine_for(self.model, self.vllm_config)

    def arm(self, spec: UpdateSpec) -> None:
        """Make the next :meth:`start` open exactly ``spec`` (the agent names the session)."""
        self._armed = spec

    def _keep(self, report: dict[str, Any]) -> dict[str, Any]:
        self.last = report
        return report

    def _check(self, report: dict[str, Any]) -> None:
        self._keep(report)
        if not report.get("ok"):
            raise TransferRefused(describe(report))

    def start(self) -> None:
        self._starts += 1
        spec = self._armed or UpdateSpec(
            update_id=f"push-{self._starts}", version=f"push-{self._starts}", mode=UpdateMode.FULL
        )
        self._armed = None
        self._check(self.engine.begin(spec.model_dump_json(by_alias=True)))

    def feed(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        if batch:
            self._check(self.engine.load_tensors(batch))

    def retarget(self, version: str) -> dict[str, Any]:
        return self._keep(self.engine.retarget(version))

    def finish(self) -> None:
        self._check(self.engine.finish("{}"))

    def poison(self, reason: str) -> dict[str, Any]:
        logger.warning("Fenced this rank: %s", reason)
        args = json.dumps({"poison": True, "reason": reason[:500]})
        report: dict[str, Any] = self.engine.abort(args)
        # Keep the report that said why (a refused load), not the abort's own.
        if self.last is None or self.last.get("ok"):
            self.last = report
        return report
