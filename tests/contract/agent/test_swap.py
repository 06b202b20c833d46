"""Contract: a prefetched update that waits for its swap (``prefetch.awaitSwap``, issue 30 item 3).

The update stops in ``Prefetched`` with the replica serving and Ready until
``POST /v1/updates/{id}/swap``; an abort or the swap deadline there frees the staging and leaves
the replica as it was (not held, not poisoned). The fake vLLM's ranks run the real session
transitions (``session.prefetch``/``drop_prefetch``), so a staging left held would refuse the
next prefetch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.contract.agent.conftest import AgentHarness, update_body

pytestmark = pytest.mark.asyncio


def parked_body(update_id: str, version: str, source: Path, **prefetch: Any) -> dict[str, Any]:
    body = update_body(update_id, version, source)
    body["source"]["manifest"] = str(source / "manifest.json")
    body["prefetch"] = {"mode": "Host", "awaitSwap": True, **prefetch}
    return body


def methods(harness: AgentHarness) -> list[str]:
    rank = harness.fake.ranks[0]
    return [name for name, _ in rank.calls if name != "weightroll_state"]


async def park(harness: AgentHarness, body: dict[str, Any]) -> dict[str, Any]:
    await harness.wait_ready()
    await harness.submit(body)
    return await harness.wait_phase(body["id"], "Prefetched", "Failed", "Aborted")


async def serving(harness: AgentHarness, version: str) -> None:
    """The replica serves ``version``, unpaused, clean and Ready."""
    await harness.wait_ready()
    assert not harness.fake.paused
    assert harness.fake.version == version
    assert {rank.state for rank in harness.fake.ranks} == {"clean"}


@pytest.mark.parametrize("fake_ranks", [1, 2])
async def test_a_parked_update_serves_until_its_swap_then_commits(
    harness: AgentHarness, checkpoints: dict[str, Path], fake_ranks: int
) -> None:
    status = await park(harness, parked_body("u-1", "v1", checkpoints["v1"]))

    assert status["phase"] == "Prefetched", status
    assert "waiting for POST /v1/updates/u-1/swap" in status["message"]
    # parked: nothing drained, nothing written, the replica serves its boot weights, Ready
    await serving(harness, "v0")
    assert methods(harness) == ["weightroll_prefetch", "weightroll_prefetched"]
    state = await (await harness.get("/v1/state")).json()
    assert (state["ready"], state["paused"], state["activeUpdateId"]) == (True, False, "u-1")

    response = await harness.post("/v1/updates/u-1/swap")
    assert response.status in (200, 202), await response.text()
    status = await harness.wait_phase("u-1")

    assert status["phase"] == "Committed", status
    assert {"prefetch", "parked", "drain", "load", "window"} <= set(status["timings"])
    await serving(harness, "v1")
    # the ranks were asked once more after the go, then the staging was applied in the drain
    assert methods(harness) == [
        "weightroll_prefetch",
        "weightroll_prefetched",
        "weightroll_prefetched",
        "weightroll_begin",
        "weightroll_apply",
        "weightroll_finish",
    ]
    # once swapping, a swap is acknowledged, not refused
    again = await harness.post("/v1/updates/u-1/swap")
    assert again.status == 200
    assert (await again.json())["phase"] == "Committed"


async def test_swap_refusals_name_the_phase(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    missing = await harness.post("/v1/updates/nope/swap")
    assert missing.status == 404
    assert (await missing.json())["field"] == "id"

    # an update that does not await its swap cannot be swapped
    await harness.wait_ready()
    await harness.submit(update_body("u-plain", "v1", checkpoints["v1"]))
    await harness.wait_phase("u-plain")
    plain = await harness.post("/v1/updates/u-plain/swap")
    assert plain.status == 409
    assert "awaitSwap is false" in (await plain.json())["message"]

    # nor one still prefetching: the ranks' read is held by the fake
    gate = harness.fake.gate("weightroll_prefetch")
    await harness.submit(parked_body("u-2", "v2", checkpoints["v2"]))
    await harness.fake.entered["weightroll_prefetch"].wait()
    early = await harness.post("/v1/updates/u-2/swap")
    assert early.status == 409
    assert (await early.json())["message"] == "update 'u-2' is in phase Prefetching, not Prefetched"
    gate.set()
    await harness.wait_phase("u-2", "Prefetched")
    assert (await harness.post("/v1/updates/u-2/swap")).status in (200, 202)
    assert (await harness.post("/v1/updates/u-2/swap")).status in (200, 202)  # idempotent
    assert (await harness.wait_phase("u-2"))["phase"] == "Committed"
    await serving(harness, "v2")


async def test_an_abort_while_parked_frees_the_staging_and_serves_on(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    assert (await park(harness, parked_body("u-1", "v1", checkpoints["v1"])))["phase"] == (
        "Prefetched"
    )

    response = await harness.post("/v1/updates/u-1/abort")
    assert response.status == 200, await response.text()
    status = await harness.wait_phase("u-1")

    assert status["phase"] == "Aborted", status
    assert status["verdict"]["reasons"][0].startswith("aborted:")
    assert "drain" not in status["timings"]
    # not held, not poisoned: the replica serves its old weights, Ready, and the ranks hold no
    # staging (the abort carried no poison)
    await serving(harness, "v0")
    assert all(rank.staged is None and rank.ws.prefetched is None for rank in harness.fake.ranks)
    assert '"poison"' not in dict(harness.fake.ranks[0].calls)["weightroll_abort"]
    refused = await harness.post("/v1/updates/u-1/swap")
    assert refused.status == 409
    assert "phase Aborted" in (await refused.json())["message"]
    # the next prefetch is not refused by a staging left behind
    status = await park(harness, parked_body("u-2", "v2", checkpoints["v2"]))
    assert status["phase"] == "Prefetched", status


async def test_a_parked_update_nobody_swaps_ends_at_its_deadline_serving(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    body = parked_body("u-1", "v1", checkpoints["v1"], swapDeadlineSeconds=1)
    await harness.wait_ready()
    await harness.submit(body)

    status = await harness.wait_phase("u-1")

    assert status["phase"] == "Failed", status
    (reason,) = status["verdict"]["reasons"]
    assert reason.startswith("swap_deadline:") and "swapDeadlineSeconds=1" in reason
    await serving(harness, "v0")
    assert harness.fake.calls("weightroll_begin") == 0
    assert all(rank.staged is None for rank in harness.fake.ranks)


async def test_a_rank_that_lost_its_staging_fails_the_swap_before_the_drain(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    assert (await park(harness, parked_body("u-1", "v1", checkpoints["v1"])))["phase"] == (
        "Prefetched"
    )
    harness.fake.ranks[0].reset("v0")  # the rank restarted while parked: staging gone

    assert (await harness.post("/v1/updates/u-1/swap")).status in (200, 202)
    status = await harness.wait_phase("u-1")

    assert status["phase"] == "Failed", status
    assert "drain" not in status["timings"], status
    await serving(harness, "v0")


async def test_await_swap_needs_host_prefetch(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    body = update_body("u-1", "v1", checkpoints["v1"])
    body["prefetch"] = {"awaitSwap": True}
    response = await harness.post("/v1/updates", body)
    assert response.status == 422
    assert "awaitSwap" in (await response.json())["message"]
