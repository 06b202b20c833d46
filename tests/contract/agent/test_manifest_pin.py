"""Contract: ``source.manifestDigest`` pins the manifest's bytes (issue 28 item 5).

Before: a manifest certified itself. Whoever could write the model volume replaced a
checkpoint, regenerated its manifest, and the agent committed it for the unchanged update. Now
the update may carry the pin ``weightroll manifest`` prints; the agent hashes the manifest bytes
it parses and refuses any other before the drain, so nothing reaches the engine.

The agent is the real process (``python -m engine_agent.sidecar.main``) on a real port; vLLM is
the fake of ``tests/harness/fake_vllm.py``; ``weightroll manifest`` is the installed command.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from safetensors.numpy import save_file

from engine_agent.manifest import build_manifest, manifest_file_digest, write_manifest
from tests.contract.agent.conftest import TOKEN, update_body
from tests.harness.agent_process import AgentHttp, AgentProcesses
from tests.harness.fake_vllm import FakeVllm

pytestmark = pytest.mark.asyncio

ROOT = Path(__file__).resolve().parents[3]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class AgentProcess(AgentHttp):
    """The agent running as its own process, an HTTP client for it, and the fake behind it."""

    fake: FakeVllm = field(kw_only=True)


@pytest_asyncio.fixture
async def agent(fake: FakeVllm, token_file: Path, tmp_path: Path) -> AsyncIterator[AgentProcess]:
    agents = AgentProcesses(fake.url, token_file, tmp_path, ready_headers=AUTH)
    try:
        # ready, not just listening: updates before recovery are 409
        started = await agents.start()
        async with ClientSession() as http:
            yield AgentProcess(started.url, http, AUTH, fake=fake)
    finally:
        await agents.stop()


def _swap_checkpoint(directory: Path, seed: int) -> None:
    """What a writer of the model volume can do: other weights, and a manifest that fits them."""
    rng = np.random.default_rng(seed)
    for path in sorted(directory.glob("*.safetensors")):
        save_file({"lm_head.weight": rng.standard_normal((32, 16), dtype=np.float32)}, str(path))
    for path in sorted(directory.glob("*.safetensors"))[1:]:
        path.unlink()
    write_manifest(build_manifest(directory, version="v2"), directory / "manifest.json")


def _pinned(source: Path, pin: str, update_id: str = "u-1") -> dict[str, Any]:
    body = update_body(update_id, "v2", source)
    body["source"].update(manifest=str(source / "manifest.json"), manifestDigest=pin)
    return body


async def test_a_swapped_manifest_is_refused_before_anything_reaches_the_engine(
    agent: AgentProcess, checkpoints: dict[str, Path]
) -> None:
    source = checkpoints["v2"]
    pin = manifest_file_digest((source / "manifest.json").read_bytes())
    _swap_checkpoint(source, seed=99)  # after the WeightUpdate was written with the pin

    status = await agent.run_update(_pinned(source, pin))

    assert status["phase"] == "Failed", status
    reason = status["verdict"]["reasons"][0]
    assert reason.startswith("manifest_digest_mismatch:"), reason
    assert "spec.source.manifestDigest" in reason and pin in reason, reason
    fake = agent.fake
    # nothing was written: no rank session, no load, every rank clean at its boot weights
    for method in ("weightroll_begin", "weightroll_load", "weightroll_finish"):
        assert fake.calls(method) == 0, method
    assert {(rank.state, rank.version) for rank in fake.ranks} == {("clean", "v0")}
    assert all(rank.loaded_bytes == 0 for rank in fake.ranks)
    # held like any failed update: not ready, and generation paused by the guard
    code, ready = await agent.readyz()
    assert code == 503 and any("manifest_digest_mismatch" in r for r in ready["reasons"]), ready
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while not fake.paused:
        assert loop.time() < end, "the held replica was never paused"
        await asyncio.sleep(0.05)
    _, state = await agent.request("GET", "/v1/state")
    assert state["committedVersion"] == "v0" and state["ready"] is False, state


async def test_the_pinned_manifest_commits(
    agent: AgentProcess, checkpoints: dict[str, Path]
) -> None:
    source = checkpoints["v2"]
    pin = manifest_file_digest((source / "manifest.json").read_bytes())

    status = await agent.run_update(_pinned(source, pin))

    assert status["phase"] == "Committed", status
    assert {(rank.state, rank.version) for rank in agent.fake.ranks} == {("clean", "v2")}
    _, state = await agent.request("GET", "/v1/state")
    assert state["source"]["manifestDigest"] == pin, state  # what the operator compares


async def test_weightroll_manifest_prints_the_pin_the_agent_accepts(
    agent: AgentProcess, checkpoints: dict[str, Path]
) -> None:
    source = checkpoints["v2"]
    script = Path(sys.executable).with_name("weightroll")
    command = (
        [str(script)] if script.exists() else [sys.executable, "-m", "weightroll_operator.cli"]
    )
    done = subprocess.run(
        [
            *command,
            "manifest",
            str(source),
            "--version",
            "v2",
            "--out",
            str(source / "manifest.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    pin = done.stdout.strip()
    assert pin.startswith("sha256:") and len(pin) == 71, done.stdout
    assert f"spec.source.manifestDigest: {pin}" in done.stderr, done.stderr

    status = await agent.run_update(_pinned(source, pin))
    assert status["phase"] == "Committed", status

    # the same command after the volume changed prints another pin, which the old one refuses
    _swap_checkpoint(source, seed=7)
    status = await agent.run_update(_pinned(source, pin, "u-2"))
    assert status["phase"] == "Failed", status
    assert status["verdict"]["reasons"][0].startswith("manifest_digest_mismatch:")
    assert {rank.version for rank in agent.fake.ranks} == {"v2"}
    assert agent.fake.calls("weightroll_begin") == 1  # only the first update's


async def test_a_manifest_swapped_after_the_agents_check_is_refused_by_every_rank(
    agent: AgentProcess, checkpoints: dict[str, Path]
) -> None:
    """The ranks read the manifest themselves, after the agent checked it: the pin travels with
    the load (``LoadSource.manifestDigest``), so a swap in between fails every rank's load
    before a byte is loaded, instead of being caught only at commit, after live writes."""
    source = checkpoints["v2"]
    pin = manifest_file_digest((source / "manifest.json").read_bytes())
    fake = agent.fake
    release = fake.gate("weightroll_load")
    status, answer = await agent.request("POST", "/v1/updates", _pinned(source, pin))
    assert status == 202, answer
    await asyncio.wait_for(fake.entered["weightroll_load"].wait(), 20)
    _swap_checkpoint(source, seed=5)  # the agent has checked the pin; the ranks have not read
    release.set()

    loop = asyncio.get_running_loop()
    end = loop.time() + 20
    while True:
        _, answer = await agent.request("GET", "/v1/updates/u-1")
        if answer["phase"] in ("Committed", "Failed", "Aborted"):
            break
        assert loop.time() < end, answer
        await asyncio.sleep(0.05)
    assert answer["phase"] == "Failed", answer
    assert "manifest" in " ".join(answer["verdict"]["reasons"]), answer
    assert all(rank.loaded_bytes == 0 for rank in fake.ranks)
    assert {rank.version for rank in fake.ranks} == {"v0"}
