"""When the next pass of a WeightUpdate runs: soon after anything it depends on changed.

Issue 11 finding 10: a fixed 5 s timer made every unit wait up to 5 s after its agent committed,
and after every pod write. Here each WeightUpdate has one long-running loop (a kopf daemon, see
``handlers.py``; the benchmark drives the same loop) that runs a pass, then sleeps until one of:

* a **wake-up**: a watch event of a pod in the WeightUpdate's namespace (our own claim, drain
  and restore, the kubelet's Ready flip, a new or deleted pod) or a change of the WeightUpdate;
* the pass's own **delay**: ``poll_interval`` (default 0.5 s) while units are in flight — the
  agents' commits are not pod events, so in-flight units are polled — and ``interval``
  (default 5 s, a resync) otherwise; none at all when the pass left forward steps to the next
  (more than ``burst`` pods were due: a batch of 1,000 is four passes of 250, back to back);
* the daemon being stopped (the object is deleted, or the operator shuts down).

So a commit is seen within ``poll_interval`` and every pod-side step within one watch round
trip, at the shipped defaults.

Limitations:
    * In-flight agents are polled: with U units in flight the operator makes about
      U / ``poll_interval`` agent calls per second (a long-poll on the agent would make that one
      request per unit).
    * A wake-up coalesces: events that arrive during a pass cause exactly one more pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["Wakeups", "drive", "nap"]

log = logging.getLogger(__name__)


@dataclass
class Wakeups:
    """One wake-up event per running WeightUpdate loop, found by namespace."""

    _events: dict[str, dict[str, asyncio.Event]] = field(default_factory=dict)

    def register(self, namespace: str, name: str) -> asyncio.Event:
        """The event the loop of ``namespace/name`` sleeps on (created on first use)."""
        return self._events.setdefault(namespace, {}).setdefault(name, asyncio.Event())

    def unregister(self, namespace: str, name: str) -> None:
        loops = self._events.get(namespace, {})
        loops.pop(name, None)
        if not loops:
            self._events.pop(namespace, None)

    def wake(self, namespace: str, name: str | None = None) -> int:
        """Wake the loop of ``namespace/name``, or every loop of ``namespace``; return how many."""
        loops = self._events.get(namespace, {})
        targets = (
            list(loops.values()) if name is None else [e for n, e in loops.items() if n == name]
        )
        for event in targets:
            event.set()
        return len(targets)


async def nap(event: asyncio.Event, delay: float, stopped: Callable[[], bool]) -> None:
    """Sleep up to ``delay`` seconds; return early when ``event`` is set or ``stopped()``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + delay
    while not event.is_set() and not stopped():
        left = end - loop.time()
        if left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), min(left, 1.0))


async def drive(
    run_pass: Callable[[], Awaitable[float]],
    event: asyncio.Event,
    stopped: Callable[[], bool],
) -> None:
    """Run ``run_pass`` until ``stopped()``; between passes :func:`nap` for the delay it returns.

    The event is cleared *before* each pass, so a change observed during a pass is never lost:
    it sets the event again and the next pass follows — after a pause as long as the pass took,
    so that a namespace whose pods change all the time costs at most half a core.
    """
    loop = asyncio.get_running_loop()
    while not stopped():
        event.clear()
        began = loop.time()
        delay = await run_pass()
        spent = loop.time() - began
        if event.is_set() and not stopped():
            await asyncio.sleep(min(spent, delay))
        await nap(event, delay, stopped)
