"""Cyclic garbage collection paced for the operator's large, long-lived heap (issue 11 G).

At 10,000 pods the operator holds about 260,000 objects that CPython's cyclic collector tracks
(the watch's pod objects, their views, units, agent answers). During a rollout the automatic
*full* collection walks all of them every few seconds, inside whichever pass allocated last:
100 to 200 ms each on a 2-core AMD EPYC, two thirds of the slowest passes of
``bench/operator_scale.py``. Nearly all of that heap is acyclic: reference counting frees an
object when a newer one replaces it, and the full walks find next to nothing.

So after each pass :class:`GcPacer` freezes what survived (``gc.freeze``: moved out of the
collector's generations, as CPython's docs suggest for a long-lived heap), and the automatic
collections walk only what was allocated since. Once every ``interval`` seconds it unfreezes
and collects everything, at the end of a pass (the pass's time includes it), so a reference
cycle that became garbage while frozen is held for at most one interval.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["GcPacer"]


@dataclass
class GcPacer:
    """Freeze the heap after each pass; collect it in full every ``interval`` seconds.

    Args:
        interval: seconds between full collections; ``0`` (or less) leaves CPython's
            automatic collection as it is and never freezes.
        clock: monotonic seconds (tests inject one).
    """

    interval: float = 60.0
    clock: Callable[[], float] = time.monotonic
    #: Full collections run so far (the benchmark reports it).
    full_collections: int = 0
    _last_full: float | None = field(default=None, init=False)

    def after_pass(self) -> None:
        """Call at the end of a pass, outside any ``paused_gc`` step."""
        if self.interval <= 0:
            return
        now = self.clock()
        if self._last_full is None:
            self._last_full = now  # the first interval counts from the first pass
        elif now - self._last_full >= self.interval:
            gc.unfreeze()
            gc.collect()
            self.full_collections += 1
            self._last_full = now
        gc.freeze()

    def release(self) -> None:
        """Give everything back to the collector (shutdown, or a test that is done)."""
        gc.unfreeze()
