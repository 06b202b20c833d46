"""Contract: restarts of vLLM or of the agent never leave an unverified replica ready."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientError, ClientSession

from engine_agent.reload import session
from tests.contract.agent.conftest import (
    TOKEN,
    AgentHarness,
    start_harness,
    stop_harness,
    update_body,
)
from tests.harness.fake_vllm import FakeVllm
from tests.harness.ports import free_port

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[3]


async def _until(predicate: Any, timeout: float = 10) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.02)


async def test_vllm_restart_after_commit_is_detected_and_repaused(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.wait_phase("u-1")
    await harness.wait_ready()
    state = await (await harness.get("/v1/state")).json()
    assert (state["version"], state["committedVersion"], state["committedUpdateId"]) == (
        "v1",
        "v1",
        "u-1",
    )

    await harness.fake.restart()  # comes back serving its boot weights (v0), unpaused

    body = await harness.wait_ready(False)
    assert any("engine_restarted" in reason for reason in body["reasons"]), body
    await _until(lambda: harness.fake.paused)
    state = await (await harness.get("/v1/state")).json()
    assert state["ready"] is False
    assert "vLLM was restarted" in state["message"]
    # /v1/state says what the ranks serve now (boot weights), not the last record (issue 11
    # finding 2); no commit is claimed for them.
    assert (state["version"], state["committedVersion"], state["committedUpdateId"]) == (
        "v0",
        "v1",
        None,
    )
    # The update record still says what was committed; recovery is a new full update.
    await harness.submit(update_body("u-2", "v1", checkpoints["v1"]))
    assert (await harness.wait_phase("u-2"))["phase"] == "Committed"
    await harness.wait_ready()
    state = await (await harness.get("/v1/state")).json()
    assert (state["version"], state["committedUpdateId"]) == ("v1", "u-2")


async def test_vllm_restart_onto_boot_weights_with_the_committed_label_is_detected(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    """vLLM restarted onto boot weights labelled like the last commit (a pod booted at v1 and
    reloaded with v1 from other files, say): the label matches, the commit is gone. Its ranks
    no longer report the commit's id, so the agent holds the replica and claims no commit."""
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.wait_phase("u-1")
    await harness.wait_ready()
    state = await (await harness.get("/v1/state")).json()
    assert (state["version"], state["committedUpdateId"]) == ("v1", "u-1")
    loaded = state["source"]["uri"]
    assert loaded.endswith(str(checkpoints["v1"])), state

    harness.fake.boot_version = "v1"
    await harness.fake.restart()

    body = await harness.wait_ready(False)
    assert any("engine_restarted" in reason for reason in body["reasons"]), body
    assert any("same label" in reason for reason in body["reasons"]), body
    await _until(lambda: harness.fake.paused)
    state = await (await harness.get("/v1/state")).json()
    assert (state["version"], state["committedVersion"], state["committedUpdateId"]) == (
        "v1",
        "v1",
        None,
    )
    assert state["ready"] is False
    # the files the commit loaded are not what the restarted ranks serve
    assert state["source"] is None or state["source"]["uri"] != loaded, state
    await harness.submit(update_body("u-2", "v1", checkpoints["v1"]))
    assert (await harness.wait_phase("u-2"))["phase"] == "Committed"
    await harness.wait_ready()
    state = await (await harness.get("/v1/state")).json()
    assert (state["version"], state["committedUpdateId"], state["ready"]) == ("v1", "u-2", True)


async def test_vllm_restart_mid_update_fails_the_update_and_holds(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    gate = harness.fake.gate("weightroll_load")
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await harness.fake.entered["weightroll_load"].wait()
    harness.fake.gates.clear()
    gate.set()
    await harness.fake.restart(down_seconds=0.2)

    status = await harness.wait_phase("u-1")

    assert status["phase"] == "Failed"
    assert status["verdict"]["reasons"][0].startswith(("engine_unavailable:", "engine_")), status
    await _until(lambda: harness.fake.paused)  # the restarted vLLM is paused again
    body = await harness.wait_ready(False)
    assert any("did not commit" in reason for reason in body["reasons"])


async def test_vllm_down_at_agent_start_is_not_ready_until_it_answers(
    fake: FakeVllm, token_file: Path, tmp_path: Path
) -> None:
    await fake.stop()
    start = asyncio.create_task(start_harness(fake, token_file, tmp_path / "state"))
    await asyncio.sleep(0.3)
    assert not start.done()
    await fake.start(fake.port)
    harness = await start
    try:
        await harness.wait_ready()
    finally:
        await stop_harness(harness)


async def _agent_restarted_without_state(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> AgentHarness:
    """u-1 committed v1 by one agent; returns a second agent, started with no state."""
    first = await start_harness(fake, token_file, tmp_path / "state-a")
    await first.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await first.wait_phase("u-1")
    await stop_harness(first)
    return await start_harness(fake, token_file, tmp_path / "state-b")


async def test_agent_restart_without_state_rederives_from_ranks(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    # A fresh agent with no memory adopts the version every rank reports.
    second = await _agent_restarted_without_state(fake, token_file, tmp_path, checkpoints)
    try:
        await second.wait_ready()
        state = await (await second.get("/v1/state")).json()
        assert state["version"] == "v1"
        # A poisoned engine is never ready, whatever the agent remembers.
        for rank in fake.ranks:
            rank.ws = session.poison(rank.ws, "test")
        body = await second.wait_ready(False)
        assert any("poisoned" in reason for reason in body["reasons"])
    finally:
        await stop_harness(second)


async def test_an_agent_restarted_without_state_learns_the_commit_from_the_ranks(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    """Restarted without its state, the agent once knew no commit id, so a later restart of
    vLLM onto boot weights with the committed label passed unseen. The ranks keep the id: the
    fresh agent adopts it (the source it loaded is unknown now) and holds on that restart."""
    second = await _agent_restarted_without_state(fake, token_file, tmp_path, checkpoints)
    try:
        await second.wait_ready()
        state = await (await second.get("/v1/state")).json()
        assert (state["version"], state["committedUpdateId"], state["source"]) == (
            "v1",
            "u-1",
            None,
        )
        # Which files u-1 loaded is lost with the state: no delta may assume they were v1's.
        refused = await second.post(
            "/v1/updates",
            update_body("u-2", "v2", checkpoints["v2"], mode="sparse", baseVersion="v1"),
        )
        assert refused.status == 409, await refused.text()
        assert "unknown" in (await refused.json())["message"]
        fake.boot_version = "v1"
        await fake.restart()
        body = await second.wait_ready(False)
        assert any("engine_restarted" in reason for reason in body["reasons"]), body
        state = await (await second.get("/v1/state")).json()
        assert state["committedUpdateId"] is None and state["ready"] is False
    finally:
        await stop_harness(second)


async def test_a_delta_after_an_unseen_restart_is_refused_by_the_ranks(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    """vLLM restarted onto boot weights labelled like the last commit, and a sparse update
    arrives before the agent looked again (here it never looks on its own): the agent's hold
    cannot refuse it, so each rank does, at begin, because it does not serve the commit the
    delta names as its base. Nothing is written and the patch never labels boot weights v2."""
    harness = await start_harness(
        fake, token_file, tmp_path / "state", watch_interval=3600.0, observe_ttl=3600.0
    )
    try:
        await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
        await harness.wait_phase("u-1")
        fake.boot_version = "v1"
        await fake.restart()
        await harness.submit(
            update_body("u-2", "v2", checkpoints["v2"], mode="sparse", baseVersion="v1")
        )
        record = await harness.wait_phase("u-2")
        assert record["phase"] == "Failed", record
        assert "base_update_id" in json.dumps(record) or "'u-1'" in json.dumps(record), record
        assert {(r.state, r.version, r.committed_by) for r in fake.ranks} == {("clean", "v1", None)}
        assert not any(name == "weightroll_load" for r in fake.ranks for name, _ in r.calls[-3:])
    finally:
        await stop_harness(harness)


async def test_a_commit_the_ranks_do_not_attribute_to_the_update_fails_it(
    fake: FakeVllm, harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    """A worker extension of another release keeps no commit id: every finish "commits", but
    the ranks cannot say they serve this update's weights. The update fails (held) instead of
    committing and being held right after, which made the operator retry forever."""
    for rank in fake.ranks:
        rank.reports_commit = False
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    record = await harness.wait_phase("u-1")
    assert record["phase"] == "Failed", record
    assert "another weightroll release" in json.dumps(record), record
    body = await harness.wait_ready(False)
    assert body["reasons"], body


async def test_agent_stopped_mid_update_aborts_and_holds(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    harness = await start_harness(fake, token_file, tmp_path / "state")
    fake.gate("weightroll_load")
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    await fake.entered["weightroll_load"].wait()
    fake.gates["weightroll_load"].set()
    agent = harness.agent
    await stop_harness(harness)  # runs the app's cleanup: agent.stop()
    record = agent.get("u-1")
    assert record.phase.value == "Aborted"
    assert record.verdict is not None
    assert record.verdict.reasons[0].startswith("agent_stopped:")
    assert fake.paused
    assert agent.store.memory.hold is not None


async def _spawn_agent(fake: FakeVllm, token_file: Path, state_dir: Path, port: int) -> Any:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engine_agent.sidecar.main",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-url",
        fake.url,
        "--token-file",
        str(token_file),
        "--state-dir",
        str(state_dir),
        "--watch-interval",
        "0.1",
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def _get(http: ClientSession, url: str, timeout: float = 20) -> tuple[int, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        try:
            response = await http.get(url, headers={"Authorization": f"Bearer {TOKEN}"})
            return response.status, await response.json()
        except ClientError:
            assert loop.time() < end, f"{url} never answered"
            await asyncio.sleep(0.1)


async def _until_ready(http: ClientSession, url: str, timeout: float = 60) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while (await _get(http, url))[0] != 200:
        assert loop.time() < end, f"{url} never answered 200"
        await asyncio.sleep(0.1)


async def test_agent_killed_mid_update_and_restarted(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    state_dir = tmp_path / "state"
    process = await _spawn_agent(fake, token_file, state_dir, port)
    async with ClientSession() as http:
        try:
            # Ready, not just listening: an update posted before the agent recovered the
            # engine state is refused (409), which a loaded CI machine hit after /healthz.
            await _until_ready(http, f"{base}/readyz")
            gate = fake.gate("weightroll_load")
            response = await http.post(
                f"{base}/v1/updates",
                json=update_body("u-1", "v1", checkpoints["v1"]),
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            assert response.status == 202
            await asyncio.wait_for(fake.entered["weightroll_load"].wait(), 20)
            process.send_signal(signal.SIGKILL)
            await process.wait()
            fake.gates.clear()
            gate.set()  # the load completes on the ranks after the agent died: ranks are dirty
            await _until(lambda: {rank.state for rank in fake.ranks} == {"dirty"})

            process = await _spawn_agent(fake, token_file, state_dir, port)
            status, body = await _get(http, f"{base}/v1/updates/u-1")
            assert status == 200
            assert body["phase"] == "Failed"
            assert body["verdict"]["reasons"][0].startswith("agent_restarted:")
            assert "during phase Loading" in body["verdict"]["reasons"][0]
            await _until(lambda: {rank.state for rank in fake.ranks} == {"poisoned"})
            assert fake.paused
            status, ready = await _get(http, f"{base}/readyz")
            assert status == 503
            assert any("agent_restarted" in reason for reason in ready["reasons"]), ready
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()


async def test_state_reports_no_ranks_while_vllm_is_down(
    fake: FakeVllm, token_file: Path, tmp_path: Path
) -> None:
    """No rank reports while vLLM cannot be asked (the last ones would be stale): that is how
    the operator tells a booting engine (never claimed) from ranks left on different versions
    by a failed commit (reloaded by a retry)."""
    harness = await start_harness(fake, token_file, tmp_path / "state")
    try:
        await harness.wait_ready()
        state = await (await harness.get("/v1/state")).json()
        assert state["ranks"], state
        await fake.stop()
        await harness.wait_ready(False)
        state = await (await harness.get("/v1/state")).json()
        assert (state["version"], state["ranks"]) == ("", []), state
        await fake.start(fake.port)
        await harness.wait_ready()
    finally:
        await stop_harness(harness)
