"""The operator's liveness rule: a stalled reconcile loop makes ``/healthz`` fail.

kopf's liveness endpoint answers 200 as long as its HTTP server runs, even when every watcher
or loop is stuck (kopf#1276). :class:`Liveness` is the probe's verdict: while WeightUpdates
exist (each one's loop passes at least every ``interval`` seconds), no finished pass for longer than
``multiple`` intervals is a stall, and the probe raises so kopf answers 500 and the kubelet
restarts the operator. Without WeightUpdates there is nothing to pass over: never a stall.

Invariants:
    * Time is injected (monotonic seconds); the rule is pure apart from its two timestamps.
    * The clock of a stall starts at the later of the last pass and the moment WeightUpdates
      were first seen, so a WeightUpdate created after a quiet hour is not a stall.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Liveness", "Stalled"]


class Stalled(Exception):
    """No reconcile pass finished in time while WeightUpdates exist (the message says how long)."""


@dataclass
class Liveness:
    """Tracks reconcile passes for the liveness probe.

    Args:
        interval: the longest pause between passes of each WeightUpdate's loop.
        multiple: intervals without a finished pass that count as a stall (0 disables).
        last_pass: monotonic time of the last finished pass (or of the start).
    """

    interval: float
    multiple: float
    last_pass: float
    #: Monotonic time since which WeightUpdates exist; ``None`` while there are none.
    active_since: float | None = None

    def passed(self, now: float) -> None:
        """Record a finished pass (whatever its outcome: an error is not a stall)."""
        self.last_pass = now

    def check(self, *, active: bool, now: float) -> float:
        """The probe: seconds since the last pass, or :class:`Stalled`.

        Raises:
            Stalled: WeightUpdates exist and no pass finished for longer than the limit.
        """
        age = round(now - self.last_pass, 1)
        if not active:
            self.active_since = None
            return age
        if self.active_since is None:
            self.active_since = now
        limit = self.multiple * self.interval
        waited = now - max(self.last_pass, self.active_since)
        if limit > 0 and waited > limit:
            raise Stalled(
                f"no reconcile pass finished for {waited:.0f} s (limit {limit:.0f} s = "
                f"{self.multiple:g} x {self.interval:g} s) while WeightUpdates exist"
            )
        return age
