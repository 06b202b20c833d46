"""Contract: every fault ends Failed, paused, ``/readyz`` 503, with the cause in the verdict."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.contract.agent.conftest import AgentHarness, update_body
from tests.harness.fake_vllm import FakeVllm

pytestmark = pytest.mark.asyncio

Script = Callable[[FakeVllm, dict[str, Path]], None]


def _rank(index: int, **changes: Any) -> Script:
    def script(fake: FakeVllm, _: dict[str, Path]) -> None:
        rank = fake.ranks[index]
        for name, value in changes.items():
            current = getattr(rank, name)
            if isinstance(current, dict | set):
                current.update(value)
            else:
                setattr(rank, name, value)

    return script


def _both(*scripts: Script) -> Script:
    def script(fake: FakeVllm, checkpoints: dict[str, Path]) -> None:
        for each in scripts:
            each(fake, checkpoints)

    return script


def _tamper_checkpoint(_: FakeVllm, checkpoints: dict[str, Path]) -> None:
    """Change bytes of the checkpoint after its manifest was written."""
    path = checkpoints["v2"] / "model-00002-of-00002.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def manifest_hash_key(document: dict[str, Any]) -> str:
    """The content-hash field of this manifest's entries (``blake3`` in v2, ``sha256`` in v1)."""
    return "sha256" if document["format"].endswith("/v1") else "blake3"


def _tamper_manifest(_: FakeVllm, checkpoints: dict[str, Path]) -> None:
    """Edit one tensor hash in the manifest without updating its digest."""
    path = checkpoints["v2"] / "manifest.json"
    document = json.loads(path.read_text())
    entry = document["tensors"]["lm_head.weight"]
    entry[manifest_hash_key(document)] = "0" * 64
    path.write_text(json.dumps(document))


# (id, world size, script, expected problem code, text the verdict must contain, rank state)
CASES: list[tuple[str, int, Script, str, str, str]] = [
    (
        # tp0 wrote live bytes before tp1 failed: the abort poisons it.
        "one-rank-cannot-read",
        2,
        _rank(1, fail={"weightroll_load": "source_unavailable"}),
        "source_unavailable",
        "rank dp0:pp0:tp1:ep0",
        "poisoned",
    ),
    (
        "checkpoint-differs-from-manifest",
        2,
        _tamper_checkpoint,
        "manifest_mismatch",
        "checkpoint bytes differ",
        "clean",
    ),
    ("manifest-digest-mismatch", 1, _tamper_manifest, "manifest_mismatch", "digest mismatch", ""),
    (
        "rank-hangs-past-timeout",
        2,
        _rank(1, hang={"weightroll_finish"}),
        "engine_timeout",
        "weightroll_finish",
        "",
    ),
    (
        # tp0's finish result never arrived: whatever tp0 did, the replica cannot be trusted,
        # so the agent fences every rank (abort with poison).
        "rank-result-missing",
        2,
        _rank(0, missing={"weightroll_finish"}),
        "rank_missing",
        "1 of 2 ranks answered",
        "poisoned",
    ),
    (
        # Two results for a world of two, but both from tp0: counting alone would pass.
        "rank-result-duplicated-other-missing",
        2,
        _both(_rank(0, duplicate={"weightroll_finish"}), _rank(1, missing={"weightroll_finish"})),
        "rank_duplicate",
        "more than one result from dp0:pp0:tp0:ep0",
        "",
    ),
    (
        "duplicate-rank-key",
        2,
        _rank(1, tp=0),
        "rank_duplicate",
        "more than one result from dp0:pp0:tp0:ep0",
        "clean",
    ),
    (
        # Both ranks committed, the agent rejects the replica: the fence poisons both.
        "coverage-hash-disagrees",
        2,
        _rank(1, coverage_hash="cov-other"),
        "coverage_hash_mismatch",
        "disagree on the plan",
        "poisoned",
    ),
    (
        "identity-changed",
        1,
        _rank(0, identity_problems=["model.layers.0.mlp: data_ptr moved"]),
        "identity_changed",
        "data_ptr moved",
        "poisoned",
    ),
    (
        "wrong-update-id",
        2,
        _rank(1, wrong_update_id="someone-else"),
        "update_id_mismatch",
        "someone-else",
        "clean",
    ),
    (
        "finish-fails-on-one-rank",
        2,
        _rank(0, fail={"weightroll_finish": "coverage_incomplete"}),
        "coverage_incomplete",
        "weightroll_finish failed on rank dp0:pp0:tp0:ep0",
        "",
    ),
]


@pytest.mark.parametrize(
    ("fake_ranks", "script", "code", "text", "rank_state"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_fault_fails_closed(
    harness: AgentHarness,
    checkpoints: dict[str, Path],
    fake_ranks: int,
    script: Script,
    code: str,
    text: str,
    rank_state: str,
) -> None:
    await harness.wait_ready()
    script(harness.fake, checkpoints)
    body = update_body("u-1", "v2", checkpoints["v2"])
    body["source"]["manifest"] = str(checkpoints["v2"] / "manifest.json")
    await harness.submit(body)

    status = await harness.wait_phase("u-1", timeout=15)

    assert status["phase"] == "Failed", status
    assert status["verdict"]["committed"] is False
    reasons = status["verdict"]["reasons"]
    assert any(reason.startswith(f"{code}:") for reason in reasons), reasons
    assert any(text in reason for reason in reasons), reasons
    assert harness.fake.paused, "generation must stay paused"
    ready = await harness.wait_ready(False)
    assert any(code in reason for reason in ready["reasons"]), ready
    assert harness.fake.cache_resets == 0
    if rank_state:
        assert {rank.state for rank in harness.fake.ranks} <= {rank_state}
    state = await (await harness.get("/v1/state")).json()
    assert state["ready"] is False
    assert state["version"] == "v0"
    assert code in state["message"]


async def test_fault_before_drain_still_holds_the_replica(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    """A manifest for another version is refused before draining, and the replica is held."""
    body = update_body("u-1", "v9", checkpoints["v2"])
    body["source"]["manifest"] = str(checkpoints["v2"] / "manifest.json")
    await harness.submit(body)
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Failed"
    assert status["verdict"]["reasons"][0].startswith("manifest_version_mismatch:")
    assert harness.fake.calls("weightroll_begin") == 0
    await harness.wait_ready(False)
    assert harness.fake.paused


async def test_cache_reset_refused_keeps_the_replica_paused(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    harness.fake.cache_reset_ok = False
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Failed"
    assert status["verdict"]["reasons"][0].startswith("cache_reset_failed:")
    assert harness.fake.paused
    await harness.wait_ready(False)


async def test_rank_missing_from_state_is_not_ready(harness: AgentHarness) -> None:
    await harness.wait_ready()
    harness.fake.ranks[0].missing.add("weightroll_state")
    body = await harness.wait_ready(False)
    assert any("rank_missing" in reason for reason in body["reasons"])
    # Sticky: the replica stays held (and paused) even when the rank answers again.
    harness.fake.ranks[0].missing.clear()
    body = await harness.wait_ready(False)
    for _ in range(100):
        if harness.fake.paused:
            break
        await asyncio.sleep(0.02)
    assert harness.fake.paused, "the guard pauses a held replica"
