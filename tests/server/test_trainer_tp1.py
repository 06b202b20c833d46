"""Server tier, trainer path, TP=1: a real trainer pushes over ``weightroll_gloo`` via the agent.

One pooled replica (vLLM with backend ``weightroll_gloo``, reset to model A labelled v0, plus the
module's agent); tests run in file order and each leaves the replica committed and ready. The
last test compares with a cold engine booted on checkpoint B (tests/server/pool.py): the
differential oracle for the warm push A->B.

The gap replays need the backend: with the same transport feeding vLLM's stock layerwise reload
the half push, the q-only push and the duplicate all finish without an error (checked with
``bench/trainer.py``'s stock backend, see docs/trainer.md "Measured").
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine_agent.sidecar.transfer_routes import ROUTES
from tests.server.conftest import LLAMA_TP1, Scenario, ServerPool
from tests.server.trainer_scenario import (
    call,
    metrics,
    push,
    token_file,
    trainer_scenarios,
    weight_version,
)
from tests.server.vllm_server import ROOT

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    root = tmp_path_factory.mktemp("trainer-tp1")
    async with trainer_scenarios(pool, root, LLAMA_TP1, cold=("b",)) as (scenario,):
        yield scenario


async def recover(sc: Scenario, version: str) -> None:
    """A full push of B (the fleet's weights) commits and makes the replica ready."""
    result = await push(sc, version, sc.models.b)
    assert result["outcome"] == "committed", result
    await sc.wait_ready()


async def test_wrong_token_is_401_on_every_route(sc: Scenario) -> None:
    for route in ROUTES:
        status, body = await call(sc, route, {}, token="wrong")
        assert status == 401 and body["code"] == "unauthorized", (route, body)
    assert (await sc.readyz())[0] == 200


async def test_full_push_commits_and_serves_the_new_weights(sc: Scenario) -> None:
    result = await push(sc, "step-1", sc.models.b)
    assert (result["outcome"], result["version"], result["code"]) == ("committed", "step-1", None)
    (rank,) = result["ranks"]
    assert rank["ok"] and rank["call"] == "finish" and rank["state"] == "clean", rank
    assert rank["missingCount"] == 0 and rank["received"] == rank["required"] > 0, rank
    await sc.wait_ready()
    assert (await call(sc, "/weight_info")) == (200, {"weight_version": "step-1", "world_size": 1})
    vllm_info = await (await sc.http.get(f"{sc.server.url}/weight_info")).json()
    assert vllm_info["weight_version"] == "step-1"
    ranks = (await sc.state())["ranks"]
    assert [(r["state"], r["version"]) for r in ranks] == [("clean", "step-1")]
    warm_b = await sc.outputs()
    assert warm_b != sc.cold_a, "the push must change the completions"
    sc.notes["warm_b"] = warm_b
    text = await metrics(sc)
    assert 'weightroll_agent_trainer_pushes_total{outcome="committed"} 1.0' in text
    assert 'weightroll_agent_committed_version_info{version="step-1"} 1.0' in text
    assert "weightroll_agent_seconds_since_last_commit " in text


def _documented_trainer(agent: str, token: Path, checkpoint: Path) -> str:
    """The trainer of docs/trainer.md, with this scenario's addresses substituted."""
    text = (ROOT / "docs" / "trainer.md").read_text()
    code = re.search(r"## A trainer\n\n```python\n(.*?)```", text, re.S)
    assert code is not None, "docs/trainer.md lost its trainer example"
    source = code.group(1)
    for name, value in (
        ("AGENT", agent),
        ("TOKEN_FILE", str(token)),
        ("CHECKPOINT", str(checkpoint)),
    ):
        source, count = re.subn(rf'^{name} = "[^"]*"', f"{name} = {value!r}", source, flags=re.M)
        assert count == 1, name
    return source


async def _run(*argv: str) -> bytes:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, err.decode()[-3000:]
    return out


async def test_the_documented_trainer_and_the_example_script_commit(sc: Scenario) -> None:
    out = await _run(
        str(ROOT / "examples" / "05-trainer" / "push.py"),
        *("--agent", sc.agent.url, "--token-file", str(token_file(sc))),
        *("--checkpoint", str(sc.models.b), "--version", "step-ex"),
    )
    assert [r["outcome"] for r in json.loads(out)] == ["committed"]
    await sc.wait_ready()
    assert await weight_version(sc) == "step-ex"
    out = await _run("-c", _documented_trainer(sc.agent.url, token_file(sc), sc.models.b))
    assert "'weight_version': 'step-3'" in out.decode(), out
    await sc.wait_ready()
    assert await sc.outputs() == sc.notes["warm_b"]


async def _assert_fenced(sc: Scenario, result: dict[str, Any], code: str, text: str) -> None:
    assert result["outcome"] == "failed", result
    assert result["code"] == code and text in result["reason"], result
    body = await sc.wait_ready(False)
    assert any("did not commit" in reason for reason in body["reasons"]), body
    assert (await sc.state())["engineState"] == "poisoned"
    assert await sc.vllm_paused()


async def test_half_push_then_finish_is_refused_and_fences_the_replica(sc: Scenario) -> None:
    before = await weight_version(sc)
    result = await push(sc, "step-half", sc.models.c, shape="half")
    await _assert_fenced(sc, result, "coverage_incomplete", "never arrived")
    assert await weight_version(sc) == before
    # A retried finish: no push is open, and the answer names the failure.
    status, body = await call(sc, "/finish_weight_update", {"weight_version": "step-half"})
    assert status == 409 and body["code"] == "no_push", body
    assert "coverage_incomplete" in body["message"], body
    # An empty start/finish afterwards is still refused: nothing was received.
    assert (await call(sc, "/start_weight_update"))[0] == 200
    status, body = await call(sc, "/finish_weight_update", {"weight_version": "step-empty"})
    assert status == 422, body
    assert "coverage_incomplete" in body["message"] or "no weights" in body["message"], body
    await sc.wait_ready(False)
    assert (await sc.state())["engineState"] == "poisoned"
    assert await weight_version(sc) == before
    await recover(sc, "step-2")
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_q_without_k_and_v_is_named(sc: Scenario) -> None:
    result = await push(sc, "step-nokv", sc.models.c, shape="no-kv")
    await _assert_fenced(sc, result, "coverage_incomplete", "layers.0.self_attn.qkv_proj.weight[k]")
    assert "layers.0.self_attn.qkv_proj.weight[v]" in result["reason"], result
    await recover(sc, "step-3b")


async def test_duplicate_shard_is_refused(sc: Scenario) -> None:
    result = await push(sc, "step-dup", sc.models.c, shape="duplicate")
    await _assert_fenced(sc, result, "duplicate_shard", "layers.0.self_attn.qkv_proj.weight[q]")
    await recover(sc, "step-4")
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_a_finish_refused_for_its_version_ends_the_push_fenced(sc: Scenario) -> None:
    """Issue 26, item 9: a ``weight_version`` outside the grammar was refused (422) with the
    push left open, so every later start got 409 until ``--push-idle-timeout``; docs/api.md
    says a refused finish fences the replica and ends the push."""
    before = await weight_version(sc)
    assert (await call(sc, "/start_weight_update"))[0] == 200
    status, refused = await call(sc, "/finish_weight_update", {"weight_version": "not a version!"})
    assert (status, refused["code"]) == (422, "invalid_request"), refused
    # Fenced as any failed push: out of traffic, poisoned, paused, the version unchanged.
    ready = await sc.wait_ready(False)
    assert any("did not commit" in reason for reason in ready["reasons"]), ready
    assert (await sc.state())["engineState"] == "poisoned"
    assert await sc.vllm_paused()
    assert await weight_version(sc) == before
    # The push is closed: the trainer starts again at once (this was 409 "in progress").
    status, body = await call(sc, "/start_weight_update")
    assert status == 200, body
    assert refused["field"] == "weight_version", refused
    # The second push is open; an empty one never commits.
    status, body = await call(sc, "/finish_weight_update", {"weight_version": "step-empty-2"})
    assert status == 422, body
    await recover(sc, "step-4b")
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_vllm_restarted_mid_push(sc: Scenario) -> None:
    """Whichever side notices first ends the push: the agent's forwarded step fails against the
    dead vLLM, or (when the trainer's transport broke before it called the agent again) the
    agent's watchdog sees that the restarted ranks no longer hold the push. Either way the
    replica ends fenced and held, never blocked by a push nobody can finish."""
    hold = sc.models.root / "hold"
    hold.write_text("")
    trainer = asyncio.create_task(push(sc, "step-mid", sc.models.c, hold_file=hold))
    loop = asyncio.get_running_loop()
    end = loop.time() + 120
    while not any("push" in reason for reason in (await sc.readyz())[1]["reasons"]):
        assert loop.time() < end, "the push never started"
        await asyncio.sleep(0.2)
    # Until it commits, vLLM's own marker says no agent accepted the push: an agent restarted
    # without its state directory must not adopt the bytes (vLLM's "default" would let it). The
    # agent holds readiness first and sets the marker next, before any byte is sent: wait for it.
    while True:
        info = await (await sc.http.get(f"{sc.server.url}/weight_info")).json()
        marker = info["weight_version"]
        if marker.startswith("weightroll-unaccepted:push-"):
            break
        assert loop.time() < end and not trainer.done(), marker
        await asyncio.sleep(0.1)
    await sc.server.stop()
    hold.unlink()
    result = await trainer
    # The agent's reason, never Gloo's "Connection closed by peer" (issue 26, item 9): the
    # trainer's broadcast breaks first, and the agent's answer is what it must act on.
    assert result["outcome"] == "failed" and result["code"] is not None, result
    assert "Connection closed" not in result["reason"], result
    await sc.replica.restart()  # on A labelled v0, as the kubelet restarts the container
    end = loop.time() + 60
    body = await sc.wait_ready(False)
    while not any("engine_restarted" in reason for reason in body["reasons"]):
        assert loop.time() < end, body
        await asyncio.sleep(0.3)
        body = await sc.wait_ready(False)
    await recover(sc, "step-5")
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_a_push_of_the_same_label_is_not_attributed_to_the_earlier_update(
    sc: Scenario,
) -> None:
    """A file update commits label L by its id; a trainer push then commits L too. The agent's
    live state must attribute the weights to the push: the operator gates a pod on only when
    the commit names its own attempt, and that attempt never checked the trainer's bytes."""
    await sc.post_update("tp1-file-l", "same-label", sc.models.c)
    status = await sc.wait_phase("tp1-file-l")
    assert status["phase"] == "Committed", status
    await sc.wait_ready()
    assert (await sc.state())["committedUpdateId"] == "tp1-file-l"
    result = await push(sc, "same-label", sc.models.b)
    assert result["outcome"] == "committed", result
    await sc.wait_ready()
    state = await sc.state()
    assert state["version"] == "same-label"
    assert state["committedUpdateId"].startswith("push-"), state
    assert await sc.outputs() == sc.notes["warm_b"]


async def test_cold_engine_on_the_same_weights_equals_the_warm_push(sc: Scenario) -> None:
    # a fresh engine booted on B with the same flags (pool.py, "cold outputs")
    assert sc.cold(sc.models.b) == sc.notes["warm_b"]
