"""``apply.bounded_map``: the pass's agent calls and pod writes, ``limit`` at a time, in order."""

from __future__ import annotations

import asyncio

import pytest
from weightroll_operator.apply import bounded_map


@pytest.mark.parametrize(
    ("items", "limit"),
    [(0, 4), (1, 4), (3, 1), (10, 3), (100, 32), (5, 0)],
)
def test_results_in_order_and_never_more_than_limit_in_flight(items: int, limit: int) -> None:
    in_flight = peak = 0

    async def call(x: int) -> int:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.001 * (x % 3))  # finish out of order
        in_flight -= 1
        return x * x

    out = asyncio.run(bounded_map(call, list(range(items)), limit))
    assert out == [x * x for x in range(items)]
    assert peak <= max(1, limit)
    if items >= limit > 1:
        assert peak == limit  # it does use the concurrency it is given


def test_an_error_is_raised_only_after_every_other_item_ran() -> None:
    """No call outlives the pass: when the error reaches the caller, nothing is still running."""
    done: list[int] = []
    seen_by_caller: list[int] = []

    async def call(x: int) -> int:
        if x == 0:  # fails at once, while the others are still running
            await asyncio.sleep(0)
            raise ValueError("boom")
        await asyncio.sleep(0.002)
        done.append(x)
        return x

    async def caller() -> None:
        try:
            await bounded_map(call, list(range(8)), 3)
        finally:
            seen_by_caller.extend(done)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(caller())
    assert sorted(seen_by_caller) == [1, 2, 3, 4, 5, 6, 7]
