"""Server tier, trainer path, TP=1: a real trainer pushes over ``weightroll_gloo`` via the agent.

One replica (vLLM on model A, boot version v0, backend ``weightroll_gloo``, plus the agent) for
the whole module; tests run in file order and each leaves the replica committed and ready. The
last test restarts vLLM on checkpoint B cold: the differential oracle for the warm push A->B.

The gap replays need the backend: on a build without it, vLLM refuses the server flag (unknown
backend) or, with vLLM's own layerwise ``nccl``-style lifecycle, a half push finishes "ok".
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.server.conftest import TOKEN, Models, build_models
from tests.server.trainer_scenario import (
    Replica,
    call,
    outputs,
    readyz,
    run_trainer,
    start_replica,
    state,
    stop_replica,
    wait_ready,
)
from tests.server.vllm_server import ROOT, VllmServer

pytestmark = [pytest.mark.server, pytest.mark.asyncio(loop_scope="module")]


@dataclass
class Sc:
    models: Models
    replica: Replica
    token: Path
    failpoints: Path
    http: aiohttp.ClientSession
    notes: dict[str, Any] = field(default_factory=dict)

    async def push(
        self, version: str, checkpoint: Path | None = None, shape: str = "full", **kw: Any
    ) -> dict[str, Any]:
        (result,) = await run_trainer(
            [self.replica.url], self.token, checkpoint or self.models.b, version, shape, **kw
        )
        return result

    async def recover(self, version: str) -> None:
        result = await self.push(version)
        assert result["outcome"] == "committed", result
        await wait_ready(self.http, self.replica.url)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def sc(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Sc]:
    root = tmp_path_factory.mktemp("trainer-tp1")
    models = build_models(root / "models")
    token = root / "token"
    token.write_text(TOKEN)
    failpoints = root / "failpoints"
    failpoints.write_text("")
    replica = await start_replica(root, models.a, token, failpoints=failpoints)
    scenario = Sc(models, replica, token, failpoints, aiohttp.ClientSession())
    try:
        await wait_ready(scenario.http, replica.url)
        yield scenario
    finally:
        await scenario.http.close()
        await stop_replica(scenario.replica)


async def test_wrong_token_is_401_on_every_route(sc: Sc) -> None:
    for route in (
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/weight_info",
    ):
        status, body = await call(sc.http, sc.replica.url, route, {}, token="wrong")
        assert status == 401 and body["code"] == "unauthorized", (route, body)
    assert (await readyz(sc.http, sc.replica.url))[0] == 200


async def test_full_push_commits_and_serves_the_new_weights(sc: Sc) -> None:
    sc.notes["cold_a"] = await outputs(sc.http, sc.replica.server)
    result = await sc.push("step-1")
    assert (result["outcome"], result["version"], result["code"]) == ("committed", "step-1", None)
    (rank,) = result["ranks"]
    assert rank["ok"] and rank["call"] == "finish" and rank["state"] == "clean", rank
    assert rank["missingCount"] == 0 and rank["received"] == rank["required"] > 0, rank
    await wait_ready(sc.http, sc.replica.url)
    status, info = await call(sc.http, sc.replica.url, "/weight_info")
    assert status == 200 and info == {"weight_version": "step-1", "world_size": 1}
    vllm_info = await (await sc.http.get(f"{sc.replica.server.url}/weight_info")).json()
    assert vllm_info["weight_version"] == "step-1"
    ranks = (await state(sc.http, sc.replica.url))["ranks"]
    assert [(r["state"], r["version"]) for r in ranks] == [("clean", "step-1")]
    warm_b = await outputs(sc.http, sc.replica.server)
    assert warm_b != sc.notes["cold_a"], "the push must change the completions"
    sc.notes["warm_b"] = warm_b
    metrics = await (await sc.http.get(f"{sc.replica.url}/metrics")).text()
    assert 'weightroll_agent_trainer_pushes_total{outcome="committed"} 1.0' in metrics
    assert 'weightroll_agent_committed_version_info{version="step-1"} 1.0' in metrics
    assert "weightroll_agent_seconds_since_last_commit " in metrics


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


async def test_the_documented_trainer_and_the_example_script_commit(sc: Sc) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    example = await asyncio.create_subprocess_exec(
        sys.executable,
        str(ROOT / "examples" / "05-trainer" / "push.py"),
        "--agent",
        sc.replica.url,
        "--token-file",
        str(sc.token),
        "--checkpoint",
        str(sc.models.b),
        "--version",
        "step-ex",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(example.communicate(), 300)
    assert example.returncode == 0, err.decode()[-3000:]
    assert [r["outcome"] for r in json.loads(out)] == ["committed"]
    await wait_ready(sc.http, sc.replica.url)
    assert (await call(sc.http, sc.replica.url, "/weight_info"))[1]["weight_version"] == "step-ex"
    documented = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _documented_trainer(sc.replica.url, sc.token, sc.models.b),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    out, err = await asyncio.wait_for(documented.communicate(), 300)
    assert documented.returncode == 0, err.decode()[-3000:]
    assert "'weight_version': 'step-3'" in out.decode(), out
    await wait_ready(sc.http, sc.replica.url)
    assert await outputs(sc.http, sc.replica.server) == sc.notes["warm_b"]


async def _assert_fenced(sc: Sc, result: dict[str, Any], code: str, text: str) -> None:
    assert result["outcome"] == "failed", result
    assert result["code"] == code and text in result["reason"], result
    body = await wait_ready(sc.http, sc.replica.url, want=False)
    assert any("did not commit" in reason for reason in body["reasons"]), body
    assert (await state(sc.http, sc.replica.url))["engineState"] == "poisoned"
    assert (await (await sc.http.get(f"{sc.replica.server.url}/is_paused")).json())["is_paused"]


async def test_half_push_then_finish_is_refused_and_fences_the_replica(sc: Sc) -> None:
    result = await sc.push("step-half", sc.models.c, shape="half")
    await _assert_fenced(sc, result, "coverage_incomplete", "never arrived")
    assert (await call(sc.http, sc.replica.url, "/weight_info"))[1]["weight_version"] == "step-1"
    # A retried finish: no push is open, it names the failure.
    status, body = await call(
        sc.http, sc.replica.url, "/finish_weight_update", {"weight_version": "step-half"}
    )
    assert (
        status == 409 and body["code"] == "no_push" and "coverage_incomplete" in body["message"]
    ), body
    # An empty start/finish afterwards is still refused: nothing was received.
    status, body = await call(sc.http, sc.replica.url, "/start_weight_update")
    assert status == 200, body
    status, body = await call(
        sc.http, sc.replica.url, "/finish_weight_update", {"weight_version": "step-empty"}
    )
    assert status == 422, body
    assert "coverage_incomplete" in body["message"] or "no weights" in body["message"], body
    await wait_ready(sc.http, sc.replica.url, want=False)
    assert (await state(sc.http, sc.replica.url))["engineState"] == "poisoned"
    assert (await call(sc.http, sc.replica.url, "/weight_info"))[1]["weight_version"] == "step-1"
    await sc.recover("step-2")
    assert await outputs(sc.http, sc.replica.server) == sc.notes["warm_b"]


async def test_q_without_k_and_v_is_named(sc: Sc) -> None:
    result = await sc.push("step-nokv", sc.models.c, shape="no-kv")
    await _assert_fenced(sc, result, "coverage_incomplete", "layers.0.self_attn.qkv_proj.weight[k]")
    assert "layers.0.self_attn.qkv_proj.weight[v]" in result["reason"], result
    await sc.recover("step-3")


async def test_duplicate_shard_is_refused(sc: Sc) -> None:
    result = await sc.push("step-dup", sc.models.c, shape="duplicate")
    await _assert_fenced(sc, result, "duplicate_shard", "layers.0.self_attn.qkv_proj.weight[q]")
    await sc.recover("step-4")
    assert await outputs(sc.http, sc.replica.server) == sc.notes["warm_b"]


async def test_vllm_restarted_mid_push(sc: Sc) -> None:
    hold = sc.models.root / "hold"
    hold.write_text("")
    trainer = asyncio.create_task(sc.push("step-mid", sc.models.c, hold_file=hold))
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    while not any("push" in r for r in (await readyz(sc.http, sc.replica.url))[1]["reasons"]):
        assert loop.time() < end, "the push never started"
        await asyncio.sleep(0.2)
    await sc.replica.server.stop()
    hold.unlink()
    result = await trainer
    assert result["outcome"] in ("failed", "unreachable"), result
    await sc.replica.server.start()
    body = await wait_ready(sc.http, sc.replica.url, want=False)
    end = loop.time() + 30
    while not any("engine_restarted" in r for r in body["reasons"]):
        assert loop.time() < end, body
        await asyncio.sleep(0.3)
        body = (await readyz(sc.http, sc.replica.url))[1]
    await sc.recover("step-5")
    assert await outputs(sc.http, sc.replica.server) == sc.notes["warm_b"]


async def test_cold_engine_on_the_same_weights_equals_the_warm_push(sc: Sc) -> None:
    await sc.replica.agent.stop()
    await sc.replica.server.stop()
    cold = VllmServer(model=sc.models.b, log=sc.replica.server.log, boot_version="cold-b")
    await cold.start()
    sc.replica.server = cold
    assert await outputs(sc.http, cold) == sc.notes["warm_b"]
