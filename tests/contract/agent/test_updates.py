"""Contract: the update flow against the fake vLLM: commit, idempotency, conflicts, drain, abort."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession

from tests.contract.agent.conftest import AgentHarness, update_body

pytestmark = pytest.mark.asyncio


async def _complete(fake_url: str, prompt: str) -> dict[str, Any]:
    async with ClientSession() as http:
        response = await http.post(
            f"{fake_url}/v1/completions", json={"prompt": prompt, "max_tokens": 8}
        )
        choice: dict[str, Any] = (await response.json())["choices"][0]
        return choice


@pytest.mark.parametrize("fake_ranks", [1, 2, 4])
async def test_happy_path_commits_on_every_rank(
    harness: AgentHarness, checkpoints: dict[str, Path], fake_ranks: int
) -> None:
    await harness.wait_ready()
    manifest = checkpoints["v1"] / "manifest.json"
    body = update_body("u-1", "v1", checkpoints["v1"])
    body["source"]["manifest"] = str(manifest)
    accepted = await harness.submit(body)
    assert accepted["id"] == "u-1"

    status = await harness.wait_phase("u-1")

    assert status["phase"] == "Committed", status
    assert status["verdict"] == {"committed": True, "reasons": []}
    assert {"drain", "begin", "load", "finish", "verify", "resume", "total"} <= set(
        status["timings"]
    )
    assert len(status["ranks"]) == fake_ranks
    assert {report["call"] for report in status["ranks"]} == {"finish"}
    assert all(report["ok"] and report["state"] == "clean" for report in status["ranks"])
    assert status["startedAt"] and status["finishedAt"]
    await harness.wait_ready()
    assert harness.fake.version == "v1"
    assert harness.fake.cache_resets == 1
    assert not harness.fake.paused
    # Each rank was asked once, with the manifest and the directory.
    for rank in harness.fake.ranks:
        methods = [name for name, _ in rank.calls if name != "weightroll_state"]
        assert methods == ["weightroll_begin", "weightroll_load", "weightroll_finish"]
        load_arg = dict(rank.calls)["weightroll_load"]
        assert str(manifest) in load_arg and str(checkpoints["v1"]) in load_arg
    state = await (await harness.get("/v1/state")).json()
    assert state["version"] == "v1"
    assert state["engineState"] == "clean"
    assert state["ready"] is True and state["paused"] is False
    assert state["source"]["uri"] == f"file://{checkpoints['v1']}"
    assert len(state["ranks"]) == fake_ranks
    assert (await _complete(harness.fake.url, "hi"))["text"] == "weights=v1"


async def test_post_is_idempotent_by_id(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    body = update_body("u-1", "v1", checkpoints["v1"])
    await harness.submit(body)
    again = await harness.post("/v1/updates", body)
    assert again.status == 200
    assert (await again.json())["id"] == "u-1"
    await harness.wait_phase("u-1")
    after = await harness.post("/v1/updates", body)
    assert after.status == 200
    assert (await after.json())["phase"] == "Committed"
    assert harness.fake.calls("weightroll_begin") == 1
    other = dict(body, version="v2")
    reused = await harness.post("/v1/updates", other)
    assert reused.status == 409
    assert "different request" in (await reused.json())["message"]


async def test_second_concurrent_update_is_409_naming_the_active_id(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    gate = harness.fake.gate("weightroll_load")
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.fake.entered["weightroll_load"].wait()
    response = await harness.post("/v1/updates", update_body("u-2", "v2", checkpoints["v2"]))
    assert response.status == 409
    error = await response.json()
    assert error["code"] == "conflict"
    assert error["field"] == "id" and error["activeId"] == "u-1"
    assert "u-1" in error["message"]
    status, body = await harness.readyz()
    assert status == 503 and "u-1 in progress" in body["reasons"][0]
    gate.set()
    assert (await harness.wait_phase("u-1"))["phase"] == "Committed"


async def test_wait_drain_finishes_in_flight_and_holds_new_requests(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    harness.fake.gen_seconds = 0.3
    in_flight = [asyncio.create_task(_complete(harness.fake.url, f"a{i}")) for i in range(3)]
    while harness.fake.running < 3:
        await asyncio.sleep(0.01)
    gate = harness.fake.gate("weightroll_load")
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.fake.entered["weightroll_load"].wait()
    # In-flight requests finished on the old weights before loading began.
    done = await asyncio.gather(*in_flight)
    assert [choice["finish_reason"] for choice in done] == ["length"] * 3
    assert [choice["text"] for choice in done] == ["weights=v0"] * 3
    # A request arriving during the update waits and is served by the new weights.
    harness.fake.gen_seconds = 0.01
    late = asyncio.create_task(_complete(harness.fake.url, "late"))
    await asyncio.sleep(0.1)
    assert not late.done()
    gate.set()
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Committed"
    assert status["message"].endswith("wait")
    assert (await late)["text"] == "weights=v1"
    assert all(text != "mixed" for _, text in harness.fake.requests)


async def test_wait_drain_times_out_then_aborts_in_flight(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    harness.fake.gen_seconds = 30
    in_flight = asyncio.create_task(_complete(harness.fake.url, "long"))
    while harness.fake.running < 1:
        await asyncio.sleep(0.01)
    body = update_body("u-1", "v1", checkpoints["v1"], drain={"mode": "wait", "timeoutSeconds": 1})
    await harness.submit(body)
    choice = await asyncio.wait_for(in_flight, 5)
    assert choice["finish_reason"] == "abort"
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Committed"
    assert "abort after timeout" in status["message"]
    assert 0.9 < status["timings"]["drain"] < 3


async def test_abort_drain_mode_aborts_at_once(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    harness.fake.gen_seconds = 30
    in_flight = asyncio.create_task(_complete(harness.fake.url, "long"))
    while harness.fake.running < 1:
        await asyncio.sleep(0.01)
    body = update_body("u-1", "v1", checkpoints["v1"], drain={"mode": "abort"})
    await harness.submit(body)
    assert (await asyncio.wait_for(in_flight, 5))["finish_reason"] == "abort"
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Committed"
    assert status["timings"]["drain"] < 1


async def test_abort_endpoint_stops_the_update_and_stays_paused(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    gate = harness.fake.gate("weightroll_load")
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.fake.entered["weightroll_load"].wait()
    # The ranks are busy loading: the abort answers 202 at once, the update winds down after.
    response = await harness.post("/v1/updates/u-1/abort")
    assert response.status == 202
    assert (await response.json())["message"] == "abort requested"
    gate.set()
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Aborted"
    assert status["verdict"]["committed"] is False
    assert status["verdict"]["reasons"][0].startswith("aborted:")
    assert harness.fake.paused
    assert harness.fake.calls("weightroll_abort") == 1
    assert {rank.state for rank in harness.fake.ranks} == {"poisoned"}
    body = await harness.wait_ready(False)
    assert any("did not commit" in reason for reason in body["reasons"])
    # Aborting again is harmless; unknown ids are 404.
    assert (await harness.post("/v1/updates/u-1/abort")).status == 200
    missing = await harness.post("/v1/updates/nope/abort")
    assert missing.status == 404


async def test_abort_of_a_committed_update_is_409(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.wait_phase("u-1")
    response = await harness.post("/v1/updates/u-1/abort")
    assert response.status == 409
    assert "roll back" in (await response.json())["message"]


async def test_a_full_update_recovers_a_failed_replica(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    harness.fake.ranks[0].fail["weightroll_finish"] = "coverage_incomplete"
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    assert (await harness.wait_phase("u-1"))["phase"] == "Failed"
    await harness.wait_ready(False)
    harness.fake.ranks[0].fail.clear()
    await harness.submit(update_body("u-2", "v2", checkpoints["v2"]))
    assert (await harness.wait_phase("u-2"))["phase"] == "Committed"
    await harness.wait_ready()
    assert harness.fake.version == "v2"


async def test_metrics_expose_the_contract_names(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.wait_phase("u-1")
    harness.fake.ranks[0].fail["weightroll_load"] = "source_unavailable"
    await harness.submit(update_body("u-2", "v2", checkpoints["v2"]))
    await harness.wait_phase("u-2")
    response = await harness.http.get(harness.url + "/metrics")
    assert response.status == 200
    text = await response.text()
    for line in (
        # The load failed before any live byte changed: the abort left the ranks clean, but
        # the replica is still held (not ready) until an update commits.
        'weightroll_agent_engine_state{state="clean"} 1.0',
        'weightroll_agent_engine_state{state="poisoned"} 0.0',
        "weightroll_agent_ready 0.0",
        'weightroll_agent_phase_duration_seconds_count{phase="drain"} 2.0',
        'weightroll_agent_phase_duration_seconds_count{phase="resume"} 1.0',
        'weightroll_agent_verification_failures_total{reason="source_unavailable"} 1.0',
        'weightroll_agent_updates_total{outcome="committed"} 1.0',
        'weightroll_agent_updates_total{outcome="failed"} 1.0',
    ):
        assert line in text, line
    loaded = [
        line for line in text.splitlines() if line.startswith("weightroll_agent_bytes_loaded_total")
    ]
    assert loaded and float(loaded[0].split()[-1]) > 0
