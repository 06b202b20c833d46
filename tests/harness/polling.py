"""Bounded polling for tests that wait on a real process or cluster (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(
    what: str,
    check: Callable[[], T | None],
    timeout: float,
    interval: float = 0.5,
    context: Callable[[], str] = lambda: "",
) -> T:
    """Call ``check`` every ``interval`` s until it returns something truthy, and return that;
    after ``timeout`` s fail naming ``what`` (and ``context()``, e.g. a process's log tail)."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            detail = context()
            raise AssertionError(
                f"{what}: not within {timeout}s" + (f"\n{detail}" if detail else "")
            )
        time.sleep(interval)
