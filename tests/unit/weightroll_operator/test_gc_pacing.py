"""``GcPacer``: the heap is frozen after a pass and collected in full once per interval."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from weightroll_operator.gc_pacing import GcPacer


class _Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def _cycle() -> weakref.ref[_Node]:
    return weakref.ref(_Node())  # unreachable at once, kept alive by its own cycle


def test_a_cycle_frozen_after_a_pass_is_collected_at_the_next_full_collection() -> None:
    now = [0.0]
    pacer = GcPacer(interval=60.0, clock=lambda: now[0])
    garbage = _cycle()
    pacer.after_pass()  # frozen: automatic collections no longer walk it
    assert gc.get_freeze_count() > 0
    gc.collect(1)  # what the automatic collections of a pass do
    assert garbage() is not None
    now[0] = 59.0
    pacer.after_pass()
    assert garbage() is not None and pacer.full_collections == 0
    now[0] = 60.0
    pacer.after_pass()  # one interval later: unfrozen, collected in full, frozen again
    assert garbage() is None
    assert pacer.full_collections == 1
    assert gc.get_freeze_count() > 0
    pacer.release()
    assert gc.get_freeze_count() == 0


def test_interval_zero_leaves_the_collector_alone() -> None:
    pacer = GcPacer(interval=0)
    garbage = _cycle()
    pacer.after_pass()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert garbage() is None
