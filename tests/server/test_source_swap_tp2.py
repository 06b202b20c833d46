"""Server tier, TP=2: a checkpoint directory swapped between two ranks' reads never commits.

Issue 26 item 3. Without a manifest each rank reads the source directory itself; if the
directory is replaced during the load, TP rank 0 reads checkpoint B and TP rank 1 checkpoint C.
Each rank on its own is complete and ``clean`` at the target version, so on main the agent
committed a replica serving a mix of two checkpoints: its digest check compared data-parallel
copies only. Every rank is handed every tensor of the source, so every rank of a replica must
report the same source digest (engine_agent/sidecar/agreement.py, rule 5).

The swap is ordered by failpoints, not timing: rank 0 signals once its loaders consumed the whole
checkpoint (``load.read``), rank 1 waits at the start of its load until the test has swapped the
directory. The pooled TP=2 server, one test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.server.conftest import LLAMA_TP2, Scenario, ServerPool, scenarios

pytestmark = [pytest.mark.server, pytest.mark.tp2, pytest.mark.asyncio(loop_scope="session")]

RANKS = ("dp0:pp0:tp0:ep0", "dp0:pp0:tp1:ep0")


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def sc(pool: ServerPool, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Scenario]:
    async with scenarios(pool, tmp_path_factory.mktemp("swap"), LLAMA_TP2) as (scenario,):
        yield scenario


async def _until_exists(path: Path, sc: Scenario, update_id: str) -> None:
    """Wait for a rank's ``signal:`` file; fail at once if the update ended without it."""
    while not path.exists():
        status = await sc.status(update_id)
        assert status["phase"] not in {"Committed", "Failed", "Aborted"}, status
        await asyncio.sleep(0.05)


async def test_a_source_swapped_between_the_ranks_reads_fails_and_poisons(
    sc: Scenario, tmp_path: Path
) -> None:
    live, incoming = tmp_path / "live", tmp_path / "incoming"
    shutil.copytree(sc.models.b, live)
    shutil.copytree(sc.models.c, incoming)
    read, go = tmp_path / "tp0-read", tmp_path / "tp1-go"
    sc.set_failpoints(f"load.read@tp0=signal:{read},load@tp1=wait:{go}")

    await sc.post_update("swap", "v2", live, manifest=False)
    await asyncio.wait_for(_until_exists(read, sc, "swap"), timeout=120)
    # Rank 0 has read B in full; replace the directory before rank 1 opens it.
    os.rename(live, tmp_path / "replaced")
    os.rename(incoming, live)
    go.touch()

    status = await sc.wait_phase("swap")
    # Each rank finished on its own (no other problem), but the replica may not commit: the
    # problem names the ranks on both sides of the split.
    assert status["phase"] == "Failed", status
    reasons = status["verdict"]["reasons"]
    assert [reason.partition(":")[0] for reason in reasons] == ["digest_mismatch"], reasons
    assert "2 different checkpoints" in reasons[0], reasons
    assert all(rank in reasons[0] for rank in RANKS), reasons
    # The fence holds after finish: no rank is left clean at v2 serving half of each.
    body = await sc.wait_ready(False)
    assert any("digest_mismatch" in reason for reason in body["reasons"]), body
    state = await sc.state()
    assert state["engineState"] == "poisoned", state
    assert not any(rank["state"] == "clean" for rank in state["ranks"]), state
