"""The WeightUpdate loop reacts to events, not to a timer (issue 11 finding 10).

No clock is asserted: the delays are an hour, so a loop that waited for them would hang (the
``wait_for`` guards only stop a broken loop from hanging the suite).
"""

from __future__ import annotations

import asyncio

import pytest
from weightroll_operator.loop import Wakeups, drive, nap
from weightroll_operator.settings import OperatorConfig

HOUR = 3600.0


@pytest.mark.asyncio
async def test_an_event_during_a_pass_starts_the_next_pass_without_waiting() -> None:
    wakeups = Wakeups()
    event = wakeups.register("ns", "wu")
    passes = 0

    async def one_pass() -> float:
        nonlocal passes
        passes += 1
        if passes < 3:
            assert wakeups.wake("ns") == 1  # our own pod write, seen by the pod watch
        return HOUR

    task = asyncio.create_task(drive(one_pass, event, lambda: passes >= 3))
    await asyncio.wait_for(task, timeout=60)
    assert passes == 3


@pytest.mark.asyncio
async def test_a_wakeup_from_outside_ends_the_nap() -> None:
    wakeups = Wakeups()
    event = wakeups.register("ns", "wu")
    napping = asyncio.create_task(nap(event, HOUR, lambda: False))
    await asyncio.sleep(0)
    assert wakeups.wake("other") == 0 and not napping.done()
    assert wakeups.wake("ns", "wu") == 1
    await asyncio.wait_for(napping, timeout=60)


@pytest.mark.asyncio
async def test_stopping_ends_the_loop() -> None:
    stop = False
    event = asyncio.Event()

    async def one_pass() -> float:
        nonlocal stop
        stop = True
        return HOUR

    await asyncio.wait_for(drive(one_pass, event, lambda: stop), timeout=60)


def test_shipped_defaults_see_a_commit_within_a_second() -> None:
    config = OperatorConfig()
    assert config.poll_interval <= 1.0 < config.interval


def test_a_pass_whose_writes_or_agent_calls_failed_backs_off() -> None:
    """The daemon backs off (exponentially, with jitter) after a pass with failed calls; a
    conflict is re-planned at once, and a failed Event or a skipped action is not a failure."""
    from weightroll_operator.api.v1alpha1 import Phase
    from weightroll_operator.apply import SKIPPED, ActionResult
    from weightroll_operator.domain.actions import Emit, GateOff
    from weightroll_operator.domain.fleet import pod_view
    from weightroll_operator.errors import KubeConflict, KubeError, KubeNotFound
    from weightroll_operator.reconcile import PassResult

    from tests.harness.kube_fleet import make_pod

    gate = GateOff(pod_view(make_pod("p0", "10.0.0.1", 8470), group_by=None))
    emit = Emit(reason="UnitDraining", message="m")

    def failed(*results: ActionResult) -> bool:
        return PassResult(Phase.PROGRESSING, False, (), results, 0.5).calls_failed

    assert failed(ActionResult(gate, KubeError(429, "too many requests")))
    assert not failed(ActionResult(gate, KubeConflict(409, "conflict")))
    assert not failed(ActionResult(gate, KubeNotFound(404, "the pod is gone")))
    assert not failed(ActionResult(gate, SKIPPED), ActionResult(emit, KubeError(500, "boom")))
    assert not failed()
