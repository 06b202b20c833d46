"""Contract: the replica fence holds after finish, and nothing builds on a rejected version.

Issue 10 item 4. Every rank committed, then the agent rejected the replica: the ranks must end
poisoned (not clean at the rejected version), a sparse or partial update based on it must be
refused, and an agent restarted without its state file must not adopt it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from engine_agent.manifest import build_manifest, write_manifest
from tests.contract.agent.conftest import (
    AgentHarness,
    make_checkpoint,
    start_harness,
    stop_harness,
    update_body,
)
from tests.harness.fake_vllm import FakeVllm

pytestmark = pytest.mark.asyncio

Rejection = Callable[[AgentHarness, dict[str, Path]], Awaitable[None]]


async def _coverage_mismatch(harness: AgentHarness, _: dict[str, Path]) -> None:
    harness.fake.ranks[1].coverage_hash = "cov-other"


async def _cache_reset_fails(harness: AgentHarness, _: dict[str, Path]) -> None:
    harness.fake.cache_reset_ok = False


async def _digest_not_the_manifests(harness: AgentHarness, _: dict[str, Path]) -> None:
    for rank in harness.fake.ranks:
        rank.digest = "f" * 64  # both agree, but not on the bytes the manifest lists


async def _manifest_republished(harness: AgentHarness, checkpoints: dict[str, Path]) -> None:
    """Hold finish, re-publish the manifest (another checkpoint's), then let finish run."""
    gate = harness.fake.gate("weightroll_finish")

    async def republish() -> None:
        await harness.fake.entered["weightroll_finish"].wait()
        other = make_checkpoint(checkpoints["v2"].parent, "v2-new", 7, version="v2")
        write_manifest(build_manifest(other, version="v2"), checkpoints["v2"] / "manifest.json")
        gate.set()

    harness.extra["task"] = asyncio.create_task(republish())


REJECTIONS: dict[str, tuple[Rejection, str]] = {
    "coverage-hash-mismatch": (_coverage_mismatch, "coverage_hash_mismatch"),
    "prefix-cache-reset-fails": (_cache_reset_fails, "cache_reset_failed"),
    "digest-differs-from-manifest": (_digest_not_the_manifests, "digest_manifest_mismatch"),
    "manifest-republished-mid-update": (_manifest_republished, "manifest_changed"),
}


def _v2(checkpoints: dict[str, Path], update_id: str = "u-2") -> dict[str, Any]:
    body = update_body(update_id, "v2", checkpoints["v2"])
    body["source"]["manifest"] = str(checkpoints["v2"] / "manifest.json")
    return body


async def _rejected_v2(
    harness: AgentHarness, checkpoints: dict[str, Path], rejection: Rejection, code: str
) -> None:
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    assert (await harness.wait_phase("u-1"))["phase"] == "Committed"
    await rejection(harness, checkpoints)
    await harness.submit(_v2(checkpoints))
    status = await harness.wait_phase("u-2", timeout=15)
    assert status["phase"] == "Failed", status
    assert any(r.startswith(f"{code}:") for r in status["verdict"]["reasons"]), status


@pytest.mark.parametrize("fake_ranks", [2])
@pytest.mark.parametrize("case", sorted(REJECTIONS))
async def test_a_replica_rejected_after_finish_is_poisoned_on_every_rank(
    harness: AgentHarness, checkpoints: dict[str, Path], case: str
) -> None:
    rejection, code = REJECTIONS[case]
    await _rejected_v2(harness, checkpoints, rejection, code)

    states = {(rank.state, rank.version) for rank in harness.fake.ranks}
    assert states == {("poisoned", "v2")}, "ranks left clean at a version the agent rejected"
    abort = [json.loads(arg) for name, arg in harness.fake.ranks[0].calls if name.endswith("abort")]
    assert abort and abort[-1]["poison"] is True
    ready = await harness.wait_ready(False)
    assert any(code in reason for reason in ready["reasons"]), ready
    assert harness.fake.weight_version != "v2", "vLLM's version names a rejected update"


@pytest.mark.parametrize("fake_ranks", [2])
async def test_a_sparse_patch_on_a_rejected_version_is_refused_even_if_the_fence_missed(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    # The abort that carries the fence never reaches the ranks: they stay clean at v2.
    for rank in harness.fake.ranks:
        rank.hang.add("weightroll_abort")
    await _rejected_v2(harness, checkpoints, _coverage_mismatch, "coverage_hash_mismatch")
    assert {(r.state, r.version) for r in harness.fake.ranks} == {("clean", "v2")}

    patch = update_body("u-3", "v3", checkpoints["v2"], mode="sparse", baseVersion="v2")
    response = await harness.post("/v1/updates", patch)
    assert response.status == 409, await response.text()
    assert "builds on the version this agent accepted" in (await response.json())["message"]
    partial = update_body(
        "u-4", "v3", checkpoints["v2"], mode="partial", scope=["lm_head."], baseVersion="v2"
    )
    assert (await harness.post("/v1/updates", partial)).status == 409
    assert harness.fake.calls("weightroll_begin") == 4  # u-1 and u-2 on two ranks, nothing more
    await harness.wait_ready(False)


async def test_a_sparse_patch_needs_the_accepted_version_as_its_base(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    await harness.submit(update_body("u-1", "v1", checkpoints["v1"]))
    assert (await harness.wait_phase("u-1"))["phase"] == "Committed"
    stale = update_body("u-2", "v2", checkpoints["v2"], mode="sparse", baseVersion="v0")
    response = await harness.post("/v1/updates", stale)
    assert response.status == 409
    assert "baseVersion is v0" in (await response.json())["message"]
    based = update_body("u-3", "v2", checkpoints["v2"], mode="sparse", baseVersion="v1")
    await harness.submit(based)
    assert (await harness.wait_phase("u-3"))["phase"] == "Committed"


@pytest.mark.parametrize("fake_ranks", [2])
async def test_an_agent_restarted_without_state_never_adopts_a_rejected_version(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    first = await start_harness(fake, token_file, tmp_path / "state-a")
    for rank in fake.ranks:
        rank.hang.add("weightroll_abort")  # the fence does not land
    try:
        await _rejected_v2(first, checkpoints, _coverage_mismatch, "coverage_hash_mismatch")
    finally:
        await first.agent.stop()
        await stop_harness(first)
    assert {(r.state, r.version) for r in fake.ranks} == {("clean", "v2")}

    second = await start_harness(fake, token_file, tmp_path / "state-b")  # no state file
    try:
        state = await (await second.get("/v1/state")).json()
        assert "version_not_accepted" in state["message"], state
        assert second.agent.store.memory.expected_version is None, "adopted a rejected version"
        await second.wait_ready(False)
        patch = update_body("u-3", "v3", checkpoints["v2"], mode="sparse", baseVersion="v2")
        assert (await second.post("/v1/updates", patch)).status == 409
        # A full update is the way out, and afterwards the replica serves again.
        for rank in fake.ranks:
            rank.hang.clear()
            rank.coverage_hash = None
        await second.submit(update_body("u-5", "v1", checkpoints["v1"]))
        assert (await second.wait_phase("u-5"))["phase"] == "Committed"
        await second.wait_ready()
    finally:
        await second.agent.stop()
        await stop_harness(second)


async def test_an_agent_restarted_without_state_adopts_what_it_accepted(
    fake: FakeVllm, token_file: Path, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    first = await start_harness(fake, token_file, tmp_path / "state-a")
    try:
        await first.submit(update_body("u-1", "v1", checkpoints["v1"]))
        assert (await first.wait_phase("u-1"))["phase"] == "Committed"
        assert fake.weight_version == "v1"
    finally:
        await first.agent.stop()
        await stop_harness(first)
    second = await start_harness(fake, token_file, tmp_path / "state-b")
    try:
        await second.wait_ready()
        assert (await (await second.get("/v1/state")).json())["version"] == "v1"
    finally:
        await second.agent.stop()
        await stop_harness(second)


@pytest.mark.parametrize("fake_ranks", [2])
async def test_every_rank_reports_the_manifests_digest(
    harness: AgentHarness, checkpoints: dict[str, Path]
) -> None:
    """The fake answers like the real extension: the digest of the bytes read is the manifest's."""
    await harness.submit(_v2(checkpoints, "u-1"))
    status = await harness.wait_phase("u-1")
    assert status["phase"] == "Committed", status
    want = build_manifest(checkpoints["v2"]).rank_digest()
    assert {rank["digest"] for rank in status["ranks"]} == {want}
