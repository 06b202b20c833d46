"""Server tier, TP=1: the agent drives a real vLLM server through updates, drains and faults.

One pooled server (reset to model A labelled v0, tests/server/pool.py) for the whole module; tests
run in file order and each leaves the replica committed and ready. The last test restarts vLLM
underneath the agent on checkpoint B and uses that cold engine as the differential oracle for the
warm update A->B (and leaves it to the pool, which resets it for the next module).
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from tests.server.conftest import LLAMA_TP1, MANIFEST, Scenario, ServerPool, scenarios
from tests.server.vllm_server import complete

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="session")]

LONG = 200  # tokens of an in-flight request (max_model_len is 256)


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    async with scenarios(pool, tmp_path_factory.mktemp("tp1"), LLAMA_TP1) as (scenario,):
        yield scenario


async def _long(sc: Scenario, prompt: str) -> dict[str, Any]:
    return await complete(
        sc.http, sc.server.url, str(sc.server.model), prompt, LONG, ignore_eos=True, logprobs=None
    )


async def test_happy_path_commits_and_serves_the_new_weights(sc: Scenario) -> None:
    accepted = await sc.post_update("tp1-b", "v1", sc.models.b)
    assert accepted["phase"] in ("Pending", "Draining", "Loading", "Verifying", "Committed")

    status = await sc.wait_phase("tp1-b")

    assert status["phase"] == "Committed", status
    assert status["verdict"] == {"committed": True, "reasons": []}
    assert {"drain", "begin", "load", "finish", "verify", "resume", "total"} <= set(
        status["timings"]
    )
    (rank,) = status["ranks"]
    assert rank["ok"] and rank["state"] == "clean" and rank["version"] == "v1"
    assert rank["missingCount"] == 0 and rank["identityOk"] and rank["digest"]
    assert rank["bytesLoaded"] > 0
    assert (await sc.readyz())[0] == 200
    state = await sc.state()
    assert state["version"] == "v1" and state["engineState"] == "clean"
    assert state["source"]["uri"] == f"file://{sc.models.b}"
    # the live ranks serve the commit of this update (issue 11: what GateOn is judged on)
    assert (state["committedVersion"], state["committedUpdateId"]) == ("v1", "tp1-b"), state
    warm_b = await sc.outputs()
    assert warm_b != sc.cold_a, "the update must change the completions"
    sc.notes["warm_b"] = warm_b
    sc.notes["timings_tp1"] = status["timings"]


async def test_round_trip_to_a_equals_the_cold_boot_engine(sc: Scenario) -> None:
    await sc.post_update("tp1-a", "v0b", sc.models.a)
    assert (await sc.wait_phase("tp1-a"))["phase"] == "Committed"
    assert await sc.outputs() == sc.cold_a
    await sc.recover("tp1-b2")
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_wait_drain_finishes_in_flight_requests_and_serves_late_ones_new(
    sc: Scenario,
) -> None:
    prompts = [f"request {i}" for i in range(6)]  # 4 run (max_num_seqs=4), 2 wait
    old_b = [(await _long(sc, prompt))["text"] for prompt in prompts]  # one at a time
    in_flight = [asyncio.create_task(_long(sc, prompt)) for prompt in prompts]
    # At least one request must be running in the engine before the pause, or none can run
    # before it (a fixed sleep raced vLLM's API server on 2 busy cores). If all six finish
    # first, nothing was in flight and each is served by B, which the checks below accept.
    await _until_engine(sc, lambda running, _: running >= 1 or any(t.done() for t in in_flight))
    await sc.post_update("tp1-drain", "v2", sc.models.c)
    await sc.wait_phase("tp1-drain", "Loading", "Verifying", "Committed", "Failed")
    late = asyncio.create_task(
        complete(sc.http, sc.server.url, str(sc.server.model), "Weights are reloaded", 8)
    )
    done = await asyncio.gather(*in_flight)
    status = await sc.wait_phase("tp1-drain")
    assert status["phase"] == "Committed", status
    assert status["message"].endswith("wait")
    # Nothing lost: every in-flight request completed normally.
    assert [choice["finish_reason"] for choice in done] == ["length"] * len(prompts)
    late_choice = await late
    # The request that arrived during the update is served by the new weights (C).
    cold_c = await complete(sc.http, sc.server.url, str(sc.server.model), "Weights are reloaded", 8)
    assert late_choice["text"] == cold_c["text"]
    assert late_choice["logprobs"]["token_logprobs"] == cold_c["logprobs"]["token_logprobs"]
    # No request was served by mixed weights: each equals its sequential output on B (it ran
    # before the pause) or on C (it waited in the queue and ran after the resume).
    new_c = [(await _long(sc, prompt))["text"] for prompt in prompts]
    for prompt, choice, b_text, c_text in zip(prompts, done, old_b, new_c, strict=True):
        assert choice["text"] in (b_text, c_text), f"{prompt!r} was served by mixed weights"
    assert any(c["text"] == b for c, b in zip(done, old_b, strict=True)), "none ran before"
    await sc.recover("tp1-after-drain")


async def test_abort_drain_ends_in_flight_requests_explicitly(sc: Scenario) -> None:
    # 96 requests of 200 tokens with max_num_seqs=4: ~10 s of work, most of it queued inside
    # vLLM (fewer than aiohttp's 100 connections per session, so every request is sent before
    # the update starts).
    finished_at: dict[int, float] = {}

    async def tracked(i: int) -> dict[str, Any]:
        choice = await _long(sc, f"abort {i}")
        finished_at[i] = time.monotonic()
        return choice

    in_flight = [asyncio.create_task(tracked(i)) for i in range(96)]
    # Every request must be inside vLLM (running or queued in the engine) before the pause: one
    # still in the API server when the pause lands is not in flight, and is rightly served by
    # the new weights after the resume. A fixed 0.5 s was not enough on 2 busy cores (42 of 96
    # had arrived), so the engine's own gauges are polled.
    await _until_admitted(sc, len(in_flight), finished_at)
    await sc.post_update("tp1-abort-drain", "v2", sc.models.c, drain={"mode": "abort"})
    status = await sc.wait_phase("tp1-abort-drain")
    committed_at = time.monotonic()
    assert status["phase"] == "Committed", status
    reasons = [choice["finish_reason"] for choice in await asyncio.gather(*in_flight)]
    assert set(reasons) <= {"abort", "length"}, reasons
    # While paused the engine generates nothing, so a request that was in vLLM before the
    # update either finished before the pause or was aborted by it: none may finish normally
    # after the commit. (On 2 busy cores the agent's pause can land after every request has
    # finished; then nothing was in flight and there is nothing to abort.)
    survivors = [i for i, at in finished_at.items() if at > committed_at and reasons[i] != "abort"]
    assert not survivors, f"requests {survivors[:5]} ran through an abort drain"
    await sc.recover("tp1-after-abort-drain")


async def _until_admitted(sc: Scenario, total: int, finished: dict[int, float]) -> None:
    """Wait until vLLM's engine holds every request not finished yet."""
    await _until_engine(sc, lambda running, waiting: running + waiting + len(finished) >= total)


async def _until_engine(sc: Scenario, enough: Callable[[float, float], bool]) -> None:
    """Poll vLLM's ``vllm:num_requests_running``/``_waiting`` gauges until ``enough`` holds."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = await (await sc.http.get(f"{sc.server.url}/metrics")).text()
        gauges = {"running": 0.0, "waiting": 0.0}
        for line in text.splitlines():
            for name in gauges:
                if line.startswith(f"vllm:num_requests_{name}{{"):
                    gauges[name] += float(line.rsplit(" ", 1)[1])
        if enough(gauges["running"], gauges["waiting"]):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("vLLM's engine never held the requests")


async def _assert_failed_closed(sc: Scenario, update_id: str, code: str, text: str) -> None:
    status = await sc.wait_phase(update_id)
    assert status["phase"] == "Failed", status
    reasons = status["verdict"]["reasons"]
    assert any(reason.startswith(f"{code}:") and text in reason for reason in reasons), reasons
    assert await sc.vllm_paused()
    body = await sc.wait_ready(False)
    assert any(code in reason for reason in body["reasons"]), body


async def test_rank_cannot_read_its_part(sc: Scenario) -> None:
    sc.set_failpoints("load")
    await sc.post_update("tp1-unreadable", "v2", sc.models.c)
    await _assert_failed_closed(sc, "tp1-unreadable", "source_unavailable", "tp0")
    await sc.recover("tp1-after-unreadable")


async def test_checkpoint_bytes_differ_from_the_manifest(sc: Scenario) -> None:
    tampered = sc.models.root / "c-tampered"
    shutil.copytree(sc.models.c, tampered)
    shard = next(tampered.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-2] ^= 0x01  # flip one bit of the last tensor
    shard.write_bytes(bytes(raw))
    await sc.post_update("tp1-tampered", "v2", tampered)
    await _assert_failed_closed(sc, "tp1-tampered", "manifest_mismatch", "")
    state = await sc.state()
    # The manifest is checked on the bytes the loaders consume, as they load (docs/engine.md,
    # "Sources, digests and the replica fence"): the flipped bit is in the *last* tensor, found
    # after earlier modules went live, so the rank is poisoned; it is never clean at v2.
    # (A checkpoint wrong from its first tensor leaves the rank clean: tests/engine/test_dense.py.)
    assert state["engineState"] == "poisoned", state
    assert all(r["state"] == "poisoned" for r in state["ranks"]), state
    await sc.recover("tp1-after-tampered")


async def test_corrupt_manifest_is_refused(sc: Scenario) -> None:
    broken = sc.models.root / "c-bad-manifest"
    shutil.copytree(sc.models.c, broken)
    text = (broken / MANIFEST).read_text()
    (broken / MANIFEST).write_text(text.replace('"BF16"', '"F16"', 1))
    await sc.post_update("tp1-bad-manifest", "v2", broken)
    await _assert_failed_closed(sc, "tp1-bad-manifest", "manifest_mismatch", "digest mismatch")
    await sc.recover("tp1-after-bad-manifest")


async def test_a_replica_rejected_after_finish_is_fenced(sc: Scenario) -> None:
    """Issue 10 item 4 on a real server: the rank committed, the agent rejected the replica (its
    manifest was re-published while finish ran); the rank ends poisoned, not clean at the
    rejected version, and a sparse patch based on that version is refused."""
    from engine_agent.manifest import build_manifest, write_manifest

    source = sc.models.root / "c-republished"
    shutil.copytree(sc.models.c, source)
    sc.set_failpoints("finish=hang:2")  # holds finish (below the agent's 5 s timeout)
    await sc.post_update("tp1-republished", "v2", source)
    await sc.wait_phase("tp1-republished", "Verifying")
    write_manifest(build_manifest(source, algorithm="sha256"), source / MANIFEST)
    status = await sc.wait_phase("tp1-republished")
    sc.set_failpoints("")
    assert status["phase"] == "Failed", status
    (rank,) = status["ranks"]
    assert rank["call"] == "abort" and rank["state"] == "poisoned", rank
    assert any(r.startswith("manifest_changed:") for r in status["verdict"]["reasons"]), status
    state = await sc.state()
    assert {(r["state"], r["version"]) for r in state["ranks"]} == {("poisoned", "v2")}, state
    assert await sc.vllm_paused()
    patch = {
        "id": "tp1-on-rejected",
        "version": "v3",
        "mode": "sparse",
        "baseVersion": "v2",
        "source": {"uri": f"file://{source}"},
    }
    response = await sc.http.post(f"{sc.agent.url}/v1/updates", json=patch, headers=sc.headers)
    assert response.status == 409, await response.text()
    await sc.recover("tp1-after-republished")


def _sample(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {line_start} in /metrics")


async def test_metrics_report_state_phases_bytes_and_failures(sc: Scenario) -> None:
    await sc.wait_ready()
    text = await (await sc.http.get(f"{sc.agent.url}/metrics")).text()
    assert _sample(text, 'weightroll_agent_engine_state{state="clean"}') == 1
    assert _sample(text, 'weightroll_agent_engine_state{state="poisoned"}') == 0
    assert _sample(text, "weightroll_agent_ready") == 1
    histogram = "weightroll_agent_phase_duration_seconds_count"
    for phase in ("drain", "begin", "load", "finish", "verify", "resume"):
        assert _sample(text, f'{histogram}{{phase="{phase}"}}') > 0
    assert _sample(text, "weightroll_agent_bytes_loaded_total") > 0
    failures = "weightroll_agent_verification_failures_total"
    assert _sample(text, f'{failures}{{reason="source_unavailable"}}') >= 1
    assert _sample(text, f'{failures}{{reason="manifest_mismatch"}}') >= 2
    assert _sample(text, 'weightroll_agent_updates_total{outcome="committed"}') >= 5
    assert _sample(text, 'weightroll_agent_updates_total{outcome="failed"}') >= 3


async def test_rank_that_hangs_past_its_timeout(sc: Scenario) -> None:
    """vLLM 0.32 treats a collective_rpc timeout as fatal: the engine core dies.

    The agent fails the update naming the timeout and holds the replica; once vLLM is restarted
    (by the kubelet in a pod, by hand here) on its boot weights, the agent sees a version it did
    not commit, keeps the replica paused, and a full update brings it back.
    """
    sc.set_failpoints("finish=hang:10")  # agent --finish-timeout is 5 s
    await sc.post_update("tp1-hang", "v2", sc.models.c)
    await _assert_failed_closed(sc, "tp1-hang", "engine_timeout", "weightroll_finish")
    sc.set_failpoints("")
    await sc.replica.restart()
    body = await sc.wait_ready(False)
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while not await sc.vllm_paused():
        assert loop.time() < end, f"the restarted vLLM must be paused by the agent: {body}"
        await asyncio.sleep(0.2)
    _, body = await sc.readyz()
    assert any("did not commit" in reason for reason in body["reasons"]), body
    await sc.recover("tp1-after-hang")


async def test_agent_killed_mid_update_and_restarted(sc: Scenario) -> None:
    sc.set_failpoints("load=hang:4")
    await sc.post_update("tp1-killed", "v2", sc.models.c)
    await sc.wait_phase("tp1-killed", "Loading")
    await asyncio.sleep(0.5)
    await sc.agent.kill()
    sc.set_failpoints("")
    await sc.agent.start()
    status = await sc.wait_phase("tp1-killed")
    assert status["phase"] == "Failed"
    assert status["verdict"]["reasons"][0].startswith("agent_restarted:"), status
    body = await sc.wait_ready(False)
    assert any("agent_restarted" in reason for reason in body["reasons"]), body
    # The hung load finished after the kill (dirty); the restarted agent aborted it: poisoned.
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while True:
        state = await sc.state()
        if state["ranks"] and {rank["state"] for rank in state["ranks"]} == {"poisoned"}:
            break
        assert loop.time() < end, state
        await asyncio.sleep(0.2)
    assert state["engineState"] == "poisoned"
    assert await sc.vllm_paused()
    await sc.recover("tp1-after-kill")


async def test_vllm_restarted_underneath_the_agent_and_cold_oracle(sc: Scenario) -> None:
    """Restart vLLM on checkpoint B under the label of the agent's last commit (v1): the label
    matches and here even the files do, but the agent cannot know that (boot weights under a
    label may be any files): only the ranks' record of the committing session tells a restart
    from the commit, and the agent holds the replica. B cold equals the warm A->B update."""
    before = await sc.state()
    assert before["committedUpdateId"] == "tp1-after-kill", before
    assert {rank["committedUpdateId"] for rank in before["ranks"]} == {"tp1-after-kill"}, before
    await sc.server.stop()
    body = await sc.wait_ready(False)
    assert body["reasons"]
    cold = sc.replica.booted_on(sc.models.b, "v1")
    await cold.start()
    model_a = sc.server.model
    sc.server = cold
    body = await sc.wait_ready(False)
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while not await sc.vllm_paused():
        assert loop.time() < end, "the agent must pause a vLLM restarted underneath it"
        await asyncio.sleep(0.2)
    _, body = await sc.readyz()
    assert any("engine_restarted" in reason for reason in body["reasons"]), body
    assert any("same label" in reason for reason in body["reasons"]), body
    # /v1/state reports what the restarted ranks serve (their cold boot), not the agent's last
    # commit, and claims no commit for it (issue 11, finding 2), nor the commit's files
    state = await sc.state()
    assert state["version"] == "v1" and state["committedUpdateId"] is None, state
    assert state["committedVersion"] == "v1" and not state["ready"], state
    assert state["source"] is None, state
    assert {rank["committedUpdateId"] for rank in state["ranks"]} == {None}, state
    # Differential oracle: stop the agent, resume the cold engine by hand, compare.
    await sc.agent.stop()
    await sc.http.post(f"{cold.url}/resume")
    cold_b = await sc.outputs()
    assert cold_b == sc.notes["warm_b"]
    assert model_a != cold.model
    # a fresh engine on B with the pool's flags: test_trainer_tp1's oracle too
    sc.pool.record_cold(sc.replica.flavour, sc.models.b, cold_b)
