"""The trainer's rendezvous, gated before vLLM sees it: the agent checks the peer, then every
rank checks it again, and only then is ``/init_weight_transfer_engine`` forwarded.

vLLM's NCCL rendezvous unpickles what the peer named in ``init_info`` publishes, so the peer
must be an IP address inside ``--trainer-networks`` (empty, the default, refuses every push),
and each rank's weightroll backend must accept it under its own trainer networks
(``weightroll_transfer_check_init``): a stock backend, or a rank configured narrower, is never
handed it. The rules themselves are :mod:`engine_agent.transfer.rendezvous` (pure standard
library); this module turns them into the trainer's HTTP answers (403, or 422 for a malformed
field; a rank that cannot be asked: the engine error's status).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Final, TypeVar

from engine_agent.protocol import ExtensionRpc
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import EngineError, VllmClient
from engine_agent.sidecar.push_failure import PushFailed, status_of
from engine_agent.sidecar.rounds import Problem, collect_reports
from engine_agent.transfer.rendezvous import (
    RendezvousRefused,
    check_init_info,
    check_update_info,
    require_networks,
)

__all__ = ["check_peer", "check_update", "ranks_accept", "require_trainer_networks"]

logger = logging.getLogger(__name__)

CHECK_INIT: Final = ExtensionRpc.TRANSFER_CHECK_INIT
#: Rank refusals that are policy (403), not a broken rank (409).
_POLICY_CODES: Final = frozenset({"trainer_push_disabled", "rendezvous_not_allowed"})

_T = TypeVar("_T")


def _as_push_failure(check: Callable[[], _T]) -> _T:
    """Run a rendezvous rule; a refusal as the trainer sees it: 403, or 422 for a malformed
    field."""
    try:
        return check()
    except RendezvousRefused as e:
        status = 422 if e.code == "invalid_request" else 403
        raise PushFailed(status, [Problem(e.code, str(e))], e.field) from e


def check_peer(body: dict[str, Any], config: AgentConfig) -> dict[str, Any]:
    """The ``init_info`` of an init ``body``, if its peer may be connected to.

    Raises:
        PushFailed: not an object (422), or the peer refused (403 / 422).
    """
    init_info = body.get("init_info")
    if not isinstance(init_info, dict):
        raise PushFailed(422, [Problem("invalid_request", "init_info: must be a JSON object")])
    try:
        _as_push_failure(lambda: check_init_info(init_info, config.trainer_networks))
    except PushFailed as e:
        logger.warning("Refused a trainer's rendezvous: %s", e)
        raise
    return init_info


def require_trainer_networks(config: AgentConfig) -> None:
    """Refuse a push while no trainer network is configured (403 ``trainer_push_disabled``)."""
    _as_push_failure(lambda: require_networks(config.trainer_networks))


def check_update(update_info: Any) -> None:
    """Refuse an ``update_info`` with pickled payloads (403 ``insecure_serialization``)."""
    _as_push_failure(lambda: check_update_info(update_info))


async def ranks_accept(client: VllmClient, config: AgentConfig, init_info: dict[str, Any]) -> None:
    """Every rank must accept ``init_info`` (its backend and trainer networks) before vLLM's
    init runs.

    Raises:
        PushFailed: 403 when every refusal is policy, 409 for a broken rank, or the engine
            error's status when the ranks did not answer.
    """
    try:
        world = await client.world_size()
        results = await client.collective_rpc(
            CHECK_INIT, json.dumps(init_info), config.control_timeout
        )
    except EngineError as e:
        raise PushFailed(
            status_of(e), [Problem(e.code, f"{CHECK_INIT}: the ranks did not answer: {e}")]
        ) from e
    round_ = collect_reports(CHECK_INIT, results, world)
    problems = [
        Problem(report.error.code, f"rank {report.rank.key}: {report.error.message}")
        for report in round_.reports
        if not report.ok and report.error is not None
    ] or list(round_.problems)
    if problems:
        status = 403 if all(p.code in _POLICY_CODES for p in problems) else 409
        raise PushFailed(status, problems)
