"""Shared pieces of the trainer-path server tests: replicas with ``weightroll_gloo``, a trainer.

A replica is a :class:`~tests.server.conftest.Scenario`: a pooled vLLM server (every one runs
``--weight-transfer-config '{"backend":"weightroll_gloo"}'``) plus a real ``weightroll-agent``;
the trainer is ``tests/server/trainer_proc.py``, each push in a process of its own forked from a
fork server that imported it (and torch and vLLM) once.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from tests.server import trainer_proc
from tests.server.conftest import Flavour, Scenario, ServerPool, scenarios
from tests.server.pool import TRAINER_NETWORKS

#: Each push forks from a server process that imported the trainer once (its stderr is the test's).
_TRAINERS = multiprocessing.get_context("forkserver")
_TRAINERS.set_forkserver_preload(["tests.server.trainer_proc"])
#: The trainers' own bearer token (``--trainer-token-file``); the operator's never opens the
#: trainer routes.
TRAINER_TOKEN = "server-test-trainer-token"
#: A push's finish forwards vLLM's finish and reads every rank: give a busy 2-core machine time.
AGENT_ARGS = (
    *("--finish-timeout", "60", "--load-timeout", "120"),
    *("--trainer-networks", TRAINER_NETWORKS),
)


def trainer_scenarios(
    pool: ServerPool,
    root: Path,
    flavour: Flavour,
    count: int = 1,
    *,
    cold: Sequence[str] = (),
    keep: bool = True,
) -> AbstractAsyncContextManager[list[Scenario]]:
    """Pooled replicas (every pooled server has the Gloo backend) whose agents take pushes."""
    root.mkdir(parents=True, exist_ok=True)
    trainer_token = root / "trainer-token"
    trainer_token.write_text(TRAINER_TOKEN)
    args = (*AGENT_ARGS, "--trainer-token-file", str(trainer_token))
    return scenarios(pool, root, flavour, count, cold=cold, agent_args=args, keep=keep)


def token_file(sc: Scenario) -> Path:
    """The trainers' token file of ``sc``'s agent."""
    args = sc.agent.extra
    return Path(args[args.index("--trainer-token-file") + 1])


async def run_trainer(
    agents: list[str],
    token: Path,
    checkpoint: Path,
    version: str,
    shape: str = "full",
    hold_file: Path | None = None,
    timeout: float = 300,
) -> list[dict[str, Any]]:
    """Run one push in a trainer process of its own; its per-replica results
    (``ReplicaResult`` dicts)."""
    argv = [
        *("--token-file", str(token), "--checkpoint", str(checkpoint)),
        *("--version", version, "--shape", shape),
    ]
    for agent in agents:
        argv += ["--agent", agent]
    if hold_file is not None:
        argv += ["--hold-file", str(hold_file)]
    answer, sender = _TRAINERS.Pipe(duplex=False)
    process = _TRAINERS.Process(target=trainer_proc.push_in_child, args=(argv, sender))
    process.start()
    sender.close()
    try:
        out = await asyncio.to_thread(_answer, answer, process, timeout)
    finally:
        answer.close()
    results: list[dict[str, Any]] = json.loads(out)
    return results


def _answer(answer: Connection, process: BaseProcess, timeout: float) -> str:
    """The push's JSON answer; fails if the process ended without one or overran ``timeout``."""
    try:
        if not answer.poll(timeout):
            raise AssertionError(f"the trainer did not answer in {timeout} s")
        out: str = answer.recv()
    except EOFError:
        out = ""
    finally:
        process.join(10)
        if process.exitcode is None:
            process.kill()
            process.join()
    assert process.exitcode == 0 and out, f"the trainer failed (exit code {process.exitcode})"
    return out


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
