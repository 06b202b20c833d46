"""Start-up: re-derive what the replica serves from its ranks before the agent trusts anything.

An agent may start beside a vLLM that has served for hours, under an update it was running
when it died, or without the state directory that remembered its last commit. It therefore
waits for vLLM, asks every rank, and:

* frees the staging of a prefetch interrupted before its hold (nothing was written);
* aborts any session left open on the ranks and holds the replica (``agent_restarted``);
* adopts the version every clean rank reports only when vLLM's weight version names it (or is
  vLLM's boot value ``default``: no agent ever touched this engine), else holds
  (``version_not_accepted``);
* learns from the ranks which commit they serve (they keep it in-process), so a later vLLM
  restart onto boot weights labelled the same is still told apart; that commit's source is
  lost with the state, so a WeightUpdate reloads such a pod;
* holds the replica for whatever else :func:`~engine_agent.sidecar.observation.faults` finds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from engine_agent.protocol import EngineState, ExtensionRpc
from engine_agent.sidecar.engine import EngineError
from engine_agent.sidecar.observation import RankObserver, faults
from engine_agent.sidecar.rounds import Problem, StateRound
from engine_agent.sidecar.state import Store

__all__ = ["VLLM_DEFAULT_VERSION", "recover"]

logger = logging.getLogger(__name__)

#: vLLM's weight version before anything set it.
VLLM_DEFAULT_VERSION: Final = "default"


async def recover(
    observer: RankObserver,
    store: Store,
    *,
    free_staging: bool,
    set_hold: Callable[[Problem], None],
    say: Callable[[str], None],
) -> None:
    """Wait for vLLM, then settle the replica's memory from its ranks (module doc).

    Args:
        observer: asks the ranks (its client and config are the agent's).
        store: the agent's memory; saved at the end.
        free_staging: a prefetch was interrupted before its hold: free the ranks' staging.
        set_hold: holds the replica for a problem (saved with the store).
        say: sets the agent's message (shown in ``/v1/state``).
    """
    client, config = observer.client, observer.config
    while True:
        observation = await observer.observe(fresh=True)
        if observation.reachable:
            break
        say(f"waiting for vLLM at {client.base_url}")
        await asyncio.sleep(min(1.0, config.watch_interval))
    states = observation.states
    assert states is not None
    if free_staging:
        # Without poison: nothing was written. A rank that restarted holds none (a no-op).
        with contextlib.suppress(EngineError):
            await client.collective_rpc(ExtensionRpc.ABORT, "{}", config.control_timeout)
    open_ids = sorted(
        {
            s.update_id or "?"
            for s in states.statuses
            if s.state in (EngineState.OPEN, EngineState.DIRTY)
        }
    )
    if open_ids:
        logger.warning("Aborting session(s) %s left open on the ranks", ", ".join(open_ids))
        with contextlib.suppress(EngineError):
            await client.collective_rpc(ExtensionRpc.ABORT, "{}", config.control_timeout)
        say(f"aborted session(s) {', '.join(open_ids)} found open at start-up")
        if store.memory.hold is None:
            set_hold(
                Problem(
                    "agent_restarted",
                    f"found session(s) {', '.join(open_ids)} open at start-up (agent "
                    "restarted mid-update); aborted them",
                )
            )
        observation = await observer.observe(fresh=True)
        states = observation.states or states
    memory = store.memory
    if (
        memory.expected_version is None
        and states.ok
        and states.state is EngineState.CLEAN
        and len(states.versions) == 1
    ):
        await _adopt_version(observer, store, next(iter(states.versions)), set_hold)
    _adopt_commit(store, states)
    found = faults(observation, memory)
    if found and memory.hold is None:
        set_hold(found[0])
    store.save()
    logger.info("Recovered engine state: %s", observer.state or "unknown")


async def _adopt_version(
    observer: RankObserver, store: Store, version: str, set_hold: Callable[[Problem], None]
) -> None:
    """Adopt the ranks' ``version`` only if an agent accepted it (restart without state)."""
    try:
        marker = await observer.client.weight_version()
    except EngineError as e:
        set_hold(Problem("version_not_accepted", f"cannot read vLLM's version: {e}"))
        return
    if marker in (version, VLLM_DEFAULT_VERSION):
        store.memory.expected_version = version
        logger.info("Adopted version %s reported by every rank", version)
        return
    set_hold(
        Problem(
            "version_not_accepted",
            f"the ranks serve {version}, which no agent accepted (vLLM's weight version is "
            f"{marker!r}); a full update is required",
        )
    )


def _adopt_commit(store: Store, states: StateRound) -> None:
    """Restarted without its state, the agent learns from the ranks which commit they serve
    (they keep it in-process), so a later restart of vLLM onto boot weights with the same
    label is still told apart. Where that commit's files came from is lost with the state:
    the source becomes unknown, and a WeightUpdate reloads such a pod."""
    memory = store.memory
    ids = {status.committed_update_id for status in states.statuses}
    if (
        memory.committed_update_id is not None
        or memory.hold is not None
        or not states.ok
        or states.state is not EngineState.CLEAN
        or states.versions != {memory.expected_version}
        or len(ids) != 1
        or None in ids
    ):
        return  # nothing to learn; disagreeing ranks are held by faults()
    memory.committed_update_id = ids.pop()
    memory.source = None
    logger.info(
        "Adopted commit %s (version %s) reported by every rank; its source is unknown",
        memory.committed_update_id,
        memory.expected_version,
    )
