"""Contract: signed manifests (issue 28 item 5, ``--manifest-public-key``).

Before: nothing but a per-update pin tied a manifest to anyone; a writer of the model volume
could publish any checkpoint with a manifest that fits it. Now an agent given a public key
loads a manifest only with ``<manifest>.sig``, an OpenSSF model-signing bundle by the matching
private key, over exactly the bytes it parses, signed for the update's version; anything else
fails ``manifest_signature_invalid`` before the drain, so nothing reaches the engine.

The agent is the real process (``python -m engine_agent.sidecar.main``, configured by its
``WEIGHTROLL_AGENT_*`` variables like the chart does) on a real port; vLLM is the fake of
``tests/harness/fake_vllm.py``; signatures are made with model-signing's own signer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import ClientSession
from safetensors.numpy import load_file, save_file

from engine_agent.manifest import build_manifest, write_manifest
from tests.contract.agent.conftest import TOKEN, update_body
from tests.harness.agent_process import AgentHttp, AgentProcesses
from tests.harness.fake_vllm import FakeVllm
from tests.harness.signing_keys import sign, write_key_pair

pytestmark = pytest.mark.asyncio
pytest.importorskip(
    "model_signing", reason="the signing extra (pip install -e '.[dev]') is not installed"
)

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CODE = "manifest_signature_invalid"


@dataclass
class SigningAgent(AgentHttp):
    """The agent process with a public key, an HTTP client for it, and the key pair."""

    fake: FakeVllm = field(kw_only=True)
    private_key: Path = field(kw_only=True)
    public_key: Path = field(kw_only=True)


@pytest_asyncio.fixture
async def agent(fake: FakeVllm, token_file: Path, tmp_path: Path) -> AsyncIterator[SigningAgent]:
    keys = tmp_path / "keys"
    keys.mkdir()
    private, public = write_key_pair(keys, "publisher")
    agents = AgentProcesses(fake.url, token_file, tmp_path, ready_headers=AUTH)
    try:
        started = await agents.start(manifest_public_key=str(public))
        async with ClientSession() as http:
            yield SigningAgent(
                started.url, http, AUTH, fake=fake, private_key=private, public_key=public
            )
    finally:
        await agents.stop()


def _update(source: Path, *, version: str = "v2", manifest: bool = True) -> dict[str, Any]:
    body = update_body("u-1", version, source)
    if manifest:
        body["source"]["manifest"] = str(source / "manifest.json")
    return body


async def test_a_signed_manifest_commits(agent: SigningAgent, checkpoints: dict[str, Path]) -> None:
    source = checkpoints["v2"]
    sign(source / "manifest.json", agent.private_key)

    status = await agent.run_update(_update(source))

    assert status["phase"] == "Committed", status
    assert {(rank.state, rank.version) for rank in agent.fake.ranks} == {("clean", "v2")}


def _swap_weights(source: Path) -> None:
    """What a volume writer can do: other weights, and a manifest that fits them (valid in every
    other respect) over the signed one; the signature stays."""
    rng = np.random.default_rng(99)
    for path in sorted(source.glob("*.safetensors")):
        tensors = load_file(str(path))
        save_file(
            {name: rng.standard_normal(t.shape, dtype=np.float32) for name, t in tensors.items()},
            str(path),
        )
    write_manifest(build_manifest(source, version="v2"), source / "manifest.json")


def _changed_after_signing(agent: SigningAgent, ckpts: dict[str, Path]) -> dict[str, Any]:
    sign(ckpts["v2"] / "manifest.json", agent.private_key)
    _swap_weights(ckpts["v2"])
    return _update(ckpts["v2"])


def _signed_by_another_key(agent: SigningAgent, ckpts: dict[str, Path]) -> dict[str, Any]:
    other, _ = write_key_pair(agent.private_key.parent, "attacker")
    sign(ckpts["v2"] / "manifest.json", other)
    return _update(ckpts["v2"])


def _unsigned(agent: SigningAgent, ckpts: dict[str, Path]) -> dict[str, Any]:
    return _update(ckpts["v2"])


def _another_versions_signed_manifest(
    agent: SigningAgent, ckpts: dict[str, Path]
) -> dict[str, Any]:
    sign(ckpts["v1"] / "manifest.json", agent.private_key)  # validly signed, for v1
    return _update(ckpts["v1"], version="v2")


def _no_manifest(agent: SigningAgent, ckpts: dict[str, Path]) -> dict[str, Any]:
    return _update(ckpts["v2"], manifest=False)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_changed_after_signing, "not signed by the key"),
        (_signed_by_another_key, "Key mismatch"),
        (_unsigned, "no readable signature"),
        (_another_versions_signed_manifest, "validly signed, but for version v1"),
        (_no_manifest, "names no source.manifest"),
    ],
    ids=["changed-after-signing", "another-key", "missing-sig", "replayed-version", "no-manifest"],
)
async def test_an_unverified_manifest_is_refused_before_anything_reaches_the_engine(
    agent: SigningAgent,
    checkpoints: dict[str, Path],
    make: Callable[[SigningAgent, dict[str, Path]], dict[str, Any]],
    says: str,
) -> None:
    status = await agent.run_update(make(agent, checkpoints))

    assert status["phase"] == "Failed", status
    reason = status["verdict"]["reasons"][0]
    assert reason.startswith(f"{CODE}:"), reason
    assert says in reason and "--manifest-public-key" in reason, reason
    fake = agent.fake
    # nothing was written: no rank session, no load, every rank clean at its boot weights
    for method in ("weightroll_begin", "weightroll_load", "weightroll_finish"):
        assert fake.calls(method) == 0, method
    assert {(rank.state, rank.version) for rank in fake.ranks} == {("clean", "v0")}
    assert all(rank.loaded_bytes == 0 for rank in fake.ranks)
    # held like any failed update: not ready (the reason named), generation paused by the guard
    response = await agent.http.get(agent.url + "/readyz", headers=AUTH)
    ready = await response.json()
    assert response.status == 503 and any(CODE in r for r in ready["reasons"]), ready
    loop = asyncio.get_running_loop()
    end = loop.time() + 10
    while not fake.paused:
        assert loop.time() < end, "the held replica was never paused"
        await asyncio.sleep(0.05)
    _, state = await agent.request("GET", "/v1/state")
    assert state["committedVersion"] == "v0" and state["ready"] is False, state


async def test_a_manifest_swapped_after_the_check_is_refused_by_every_rank_before_writing(
    agent: SigningAgent, checkpoints: dict[str, Path]
) -> None:
    """The ranks read the manifest themselves, after the agent: they are given the pin of the
    bytes whose signature verified, so a fitting manifest swapped in between writes nothing."""
    source = checkpoints["v2"]
    sign(source / "manifest.json", agent.private_key)
    fake = agent.fake
    release = fake.gate("weightroll_load")
    status, answer = await agent.request("POST", "/v1/updates", _update(source))
    assert status == 202, answer
    await asyncio.wait_for(fake.entered["weightroll_load"].wait(), 20)
    _swap_weights(source)  # the agent has verified the signature; the ranks have not read
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
    assert "manifest_digest_mismatch" in " ".join(answer["verdict"]["reasons"]), answer
    assert all(rank.loaded_bytes == 0 for rank in fake.ranks)
    assert {rank.version for rank in fake.ranks} == {"v0"}


@pytest.mark.parametrize("key", ["missing", "not-a-key", "private-key"])
async def test_an_unusable_public_key_stops_the_agent_at_start(
    fake: FakeVllm, token_file: Path, tmp_path: Path, key: str
) -> None:
    private, _ = write_key_pair(tmp_path, "publisher")
    path = {"missing": tmp_path / "absent.pem", "private-key": private}.get(key)
    if path is None:
        path = tmp_path / "garbage.pem"
        path.write_text("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n")
    agents = AgentProcesses(fake.url, token_file, tmp_path)
    try:
        started = await agents.start(ready=False, manifest_public_key=str(path))
        code = await asyncio.wait_for(started.process.wait(), 30)
    finally:
        await agents.stop()

    lines = started.log.read_text().strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("weightroll-agent: --manifest-public-key"), lines
    assert "WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY" in lines[0] and str(path) in lines[0], lines
