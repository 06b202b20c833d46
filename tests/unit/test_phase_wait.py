"""The cluster tiers' phase waiter (``tests.harness.apiserver.wait_for_phase``): a status left
from an earlier spec is never taken for the verdict on the current one.

The e2e retry test once read the halted rollout's ``Failed`` right after pointing it at a good
version, before the operator had observed the new generation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.harness.apiserver import wait_for_phase


def _reads(*bodies: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from bodies
    while True:
        yield bodies[-1]


def _body(generation: int, observed: int | None, phase: str) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if observed is not None:
        status["observedGeneration"] = observed
    return {"metadata": {"generation": generation}, "status": status}


@pytest.mark.parametrize(
    ("bodies", "want"),
    [
        # the spec changed: the old verdict first, then the operator's pass on generation 2
        (
            (_body(2, 1, "Failed"), _body(2, 2, "Progressing"), _body(2, 2, "Succeeded")),
            "Succeeded",
        ),
        # created: no status yet, then one without observedGeneration, then the verdict
        (
            ({"metadata": {"generation": 1}}, _body(1, None, "Failed"), _body(1, 1, "Failed")),
            "Failed",
        ),
    ],
)
def test_the_phase_counts_once_the_current_generation_is_observed(
    bodies: tuple[dict[str, Any], ...], want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tests.harness.apiserver.time.sleep", lambda _s: None)
    reads = _reads(*bodies)
    status = wait_for_phase(
        lambda: next(reads), ("Succeeded", "Failed"), timeout=60, alive=lambda: True, describe=str
    )
    assert (
        status["phase"] == want
        and status["observedGeneration"] == bodies[-1]["metadata"]["generation"]
    )


def test_a_status_never_about_the_current_spec_times_out_with_it_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr("tests.harness.apiserver.time.sleep", lambda _s: None)
    monkeypatch.setattr("tests.harness.apiserver.time.monotonic", lambda: next(clock))
    with pytest.raises(AssertionError, match='"observedGeneration": 1') as raised:
        wait_for_phase(
            lambda: _body(2, 1, "Failed"),
            ("Succeeded", "Failed"),
            timeout=30,
            alive=lambda: True,
            describe=lambda: "operator log tail",
        )
    assert "operator log tail" in str(raised.value)
