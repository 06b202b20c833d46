"""Shared pieces of the trainer-path server tests: replicas with ``weightroll_gloo``, a trainer.

A replica is a :class:`~tests.server.conftest.Scenario` (a real vLLM server started with
``--weight-transfer-config '{"backend":"weightroll_gloo"}'`` plus a real ``weightroll-agent``);
the trainer is ``tests/server/trainer_proc.py`` in its own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.server.conftest import Models, Scenario, start_scenario
from tests.server.vllm_server import ROOT

GLOO = ("--weight-transfer-config", json.dumps({"backend": "weightroll_gloo"}))
#: The trainer runs on this machine: its rendezvous (loopback) is the one trainer network,
#: for the agent (``--trainer-networks``) and for every worker (the vLLM container's variable).
TRAINER_NETWORKS = "127.0.0.1/32"
#: The trainers' own bearer token (``--trainer-token-file``); the operator's never opens the
#: trainer routes.
TRAINER_TOKEN = "server-test-trainer-token"
#: A push's finish forwards vLLM's finish and reads every rank: give a busy 2-core machine time.
AGENT_ARGS = (
    *("--finish-timeout", "60", "--load-timeout", "120"),
    *("--trainer-networks", TRAINER_NETWORKS),
)


async def start_replica(root: Path, models: Models, *, tp: int = 1) -> Scenario:
    """A replica on ``models.a`` (boot version v0) with the Gloo backend, ready."""
    root.mkdir(parents=True, exist_ok=True)
    trainer_token = root / "trainer-token"
    trainer_token.write_text(TRAINER_TOKEN)
    return await start_scenario(
        root,
        tp,
        models=models,
        server_args=GLOO,
        agent_args=(*AGENT_ARGS, "--trainer-token-file", str(trainer_token)),
        server_env={"WEIGHTROLL_TRAINER_NETWORKS": TRAINER_NETWORKS},
    )


def token_file(sc: Scenario) -> Path:
    """The trainers' token file of ``sc``'s agent."""
    return sc.agent.token_file.parent / "trainer-token"


async def run_trainer(
    agents: list[str],
    token: Path,
    checkpoint: Path,
    version: str,
    shape: str = "full",
    hold_file: Path | None = None,
    timeout: float = 300,
) -> list[dict[str, Any]]:
    """Run the trainer process; return its per-replica results (``ReplicaResult`` dicts)."""
    argv = [
        sys.executable,
        str(ROOT / "tests" / "server" / "trainer_proc.py"),
        *("--token-file", str(token), "--checkpoint", str(checkpoint)),
        *("--version", version, "--shape", shape),
    ]
    for agent in agents:
        argv += ["--agent", agent]
    if hold_file is not None:
        argv += ["--hold-file", str(hold_file)]
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout)
    assert process.returncode == 0, err.decode()[-3000:]
    results: list[dict[str, Any]] = json.loads(out)
    return results


async def push(sc: Scenario, version: str, checkpoint: Path, **kw: Any) -> dict[str, Any]:
    """One trainer push to ``sc``'s agent; its result."""
    (result,) = await run_trainer([sc.agent.url], token_file(sc), checkpoint, version, **kw)
    return result


async def call(
    sc: Scenario, route: str, body: Any = None, token: str = TRAINER_TOKEN
) -> tuple[int, dict[str, Any]]:
    """One native route on ``sc``'s agent: ``(status, body)``."""
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{sc.agent.url}{route}"
    if route == "/weight_info":
        response = await sc.http.get(url, headers=headers)
    else:
        response = await sc.http.post(url, json=body or {}, headers=headers)
    return response.status, await response.json()


async def weight_version(sc: Scenario) -> Any:
    return (await call(sc, "/weight_info"))[1]["weight_version"]


async def metrics(sc: Scenario) -> str:
    return await (await sc.http.get(f"{sc.agent.url}/metrics")).text()
