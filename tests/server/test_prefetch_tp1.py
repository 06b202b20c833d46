"""Server tier, TP=1: prefetch before the drain (issue 30) on a real vLLM server.

One pooled server (reset to model A labelled v0) for the module; tests run in file order. A
prefetched update reads and verifies its checkpoint while the replica serves its old weights (the
read is held on the rank's prefetch thread by a ``wait:`` failpoint while the test asks for
completions), then drains only to apply; a checkpoint that does not match its manifest is caught
before the drain and leaves the replica serving, unpaused and Ready. With ``awaitSwap`` the
update parks in Prefetched, the replica serving, until ``POST /v1/updates/{id}/swap``; an abort
there leaves the old weights serving.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.server.conftest import LLAMA_TP1, Scenario, ServerPool, scenarios

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="session")]

PREFETCH = {"prefetch": {"mode": "Host"}}


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    async with scenarios(pool, tmp_path_factory.mktemp("prefetch"), LLAMA_TP1) as (scenario,):
        yield scenario


async def _serving(sc: Scenario, version: str, update_id: str | None) -> None:
    """The replica serves ``version`` (committed by ``update_id``), unpaused and Ready."""
    assert not await sc.vllm_paused()
    await sc.wait_ready(True)
    state = await sc.state()
    assert (state["version"], state["engineState"], state["paused"]) == (version, "clean", False)
    assert state["committedUpdateId"] == update_id, state


async def test_the_replica_serves_while_every_rank_prefetches(sc: Scenario) -> None:
    cold_a = sc.cold_a
    sc.notes["cold_a"] = cold_a
    gate = sc.models.root / "prefetch-go"
    sc.set_failpoints(f"prefetch.read=wait:{gate}")
    await sc.post_update("pf-b", "v1", sc.models.b, **PREFETCH)
    await sc.wait_phase("pf-b", "Prefetching")

    # The rank's read waits for the gate: everything below happens during the prefetch.
    assert await sc.outputs() == cold_a
    assert (await sc.status("pf-b"))["phase"] == "Prefetching"
    assert not await sc.vllm_paused()
    assert (await sc.readyz())[0] == 200
    assert (await sc.state())["engineState"] == "clean"

    gate.write_text("")
    status = await sc.wait_phase("pf-b")
    sc.set_failpoints("")
    assert status["phase"] == "Committed", status
    assert {"preflight", "prefetch", "drain", "load", "finish", "resume", "window"} <= set(
        status["timings"]
    )
    (rank,) = status["ranks"]
    assert rank["state"] == "clean" and rank["version"] == "v1" and rank["missingCount"] == 0
    assert "prefetch_read" in rank["timings"]
    await _serving(sc, "v1", "pf-b")
    warm_b = await sc.outputs()
    assert warm_b != cold_a
    sc.notes["warm_b"] = warm_b


async def test_a_prefetched_update_serves_exactly_the_new_checkpoint(sc: Scenario) -> None:
    """Back to A by prefetch: the completions equal those of the cold engine booted on A."""
    await sc.post_update("pf-a", "v0b", sc.models.a, **PREFETCH)
    assert (await sc.wait_phase("pf-a"))["phase"] == "Committed"
    await _serving(sc, "v0b", "pf-a")
    assert await sc.outputs() == sc.notes["cold_a"]


async def test_a_corrupt_checkpoint_is_caught_before_the_drain(sc: Scenario) -> None:
    tampered = sc.models.root / "c-tampered"
    shutil.copytree(sc.models.c, tampered)
    shard = next(tampered.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-2] ^= 0x01  # one bit of the last tensor: found only once every byte was hashed
    shard.write_bytes(bytes(raw))

    await sc.post_update("pf-tampered", "v2", tampered, **PREFETCH)
    status = await sc.wait_phase("pf-tampered")

    assert status["phase"] == "Failed", status
    reasons = status["verdict"]["reasons"]
    assert any(reason.startswith("manifest_mismatch:") for reason in reasons), reasons
    assert "drain" not in status["timings"] and "window" not in status["timings"], status
    assert all(rank["state"] == "clean" for rank in status["ranks"]), status
    # never paused, never held: the replica serves the weights it served, Ready
    await _serving(sc, "v0b", "pf-a")
    assert await sc.outputs() == sc.notes["cold_a"]

    # and a following update (today's path) commits
    await sc.post_update("pf-after-tampered", "v3", sc.models.b)
    assert (await sc.wait_phase("pf-after-tampered"))["phase"] == "Committed"
    await _serving(sc, "v3", "pf-after-tampered")
    # the prefetched update to B served what today's path serves from B
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_a_prefetch_above_its_memory_limit_is_refused_before_any_read(
    sc: Scenario,
) -> None:
    await sc.post_update(
        "pf-too-big", "v4", sc.models.c, prefetch={"mode": "Host", "maxBytes": 1024}
    )
    status = await sc.wait_phase("pf-too-big")
    assert status["phase"] == "Failed", status
    reasons = status["verdict"]["reasons"]
    assert any(
        reason.startswith("prefetch_memory:") and "prefetch.maxBytes=1024" in reason
        for reason in reasons
    ), reasons
    await _serving(sc, "v3", "pf-after-tampered")


async def test_an_agent_restarted_during_a_prefetch_frees_the_staging_and_serves_on(
    sc: Scenario,
) -> None:
    gate = sc.models.root / "prefetch-never"  # never created: the read stays held
    sc.set_failpoints(f"prefetch.read=wait:{gate}")
    await sc.post_update("pf-killed", "v5", sc.models.c, **PREFETCH)
    await sc.wait_phase("pf-killed", "Prefetching")
    await sc.agent.kill()
    await sc.agent.start()
    status = await sc.wait_phase("pf-killed")
    assert status["phase"] == "Failed", status
    assert status["verdict"]["reasons"][0].startswith("agent_restarted:"), status
    # nothing was written or paused: no hold, the replica serves its commit, Ready
    await _serving(sc, "v3", "pf-after-tampered")
    sc.set_failpoints("")
    # the ranks' staging of pf-killed was freed: another update is not refused as a conflict
    await sc.post_update("pf-after-kill", "v6", sc.models.a, **PREFETCH)
    assert (await sc.wait_phase("pf-after-kill"))["phase"] == "Committed"
    await _serving(sc, "v6", "pf-after-kill")
    assert await sc.outputs() == sc.notes["cold_a"]


async def _post(sc: Scenario, path: str) -> tuple[int, dict[str, object]]:
    response = await sc.http.post(f"{sc.agent.url}{path}", headers=sc.headers)
    return response.status, await response.json()


PARKED = {"prefetch": {"mode": "Host", "awaitSwap": True}}


async def test_a_parked_prefetch_serves_until_its_swap_and_commits_as_cold(
    sc: Scenario,
) -> None:
    """``awaitSwap``: the update stops in Prefetched (the operator has not claimed the pod);
    the replica answers completions with its old weights, Ready, until the swap."""
    await sc.post_update("pf-park-b", "v7", sc.models.b, **PARKED)
    status = await sc.wait_phase("pf-park-b", "Prefetched", "Failed")
    assert status["phase"] == "Prefetched", status

    assert await sc.outputs() == sc.notes["cold_a"]
    assert (await sc.readyz())[0] == 200
    assert not await sc.vllm_paused()
    assert (await sc.status("pf-park-b"))["phase"] == "Prefetched"

    code, _ = await _post(sc, "/v1/updates/pf-park-b/swap")
    assert code in (200, 202)
    status = await sc.wait_phase("pf-park-b")
    assert status["phase"] == "Committed", status
    assert {"prefetch", "parked", "drain", "window"} <= set(status["timings"])
    await _serving(sc, "v7", "pf-park-b")
    assert await sc.outputs() == sc.notes["warm_b"]

    # and back to A the same way: exactly what the engine booted on A served
    await sc.post_update("pf-park-a", "v8", sc.models.a, **PARKED)
    assert (await sc.wait_phase("pf-park-a", "Prefetched", "Failed"))["phase"] == "Prefetched"
    await _post(sc, "/v1/updates/pf-park-a/swap")
    assert (await sc.wait_phase("pf-park-a"))["phase"] == "Committed"
    await _serving(sc, "v8", "pf-park-a")
    assert await sc.outputs() == sc.notes["cold_a"]


async def test_an_abort_while_parked_leaves_the_old_weights_serving(sc: Scenario) -> None:
    await sc.post_update("pf-park-abort", "v9", sc.models.c, **PARKED)
    assert (await sc.wait_phase("pf-park-abort", "Prefetched", "Failed"))["phase"] == ("Prefetched")

    code, _ = await _post(sc, "/v1/updates/pf-park-abort/abort")
    assert code in (200, 202)
    status = await sc.wait_phase("pf-park-abort")

    assert status["phase"] == "Aborted", status
    assert "drain" not in status["timings"], status
    assert all(rank["state"] == "clean" for rank in status["ranks"]), status
    # not held, not poisoned: A still serves, and its staging was freed (the next prefetch
    # is not refused by it)
    await _serving(sc, "v8", "pf-park-a")
    assert await sc.outputs() == sc.notes["cold_a"]
    await sc.post_update("pf-after-park", "v10", sc.models.b, **PREFETCH)
    assert (await sc.wait_phase("pf-after-park"))["phase"] == "Committed"
    assert await sc.outputs() == sc.notes["warm_b"]
