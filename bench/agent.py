"""Benchmark the sidecar's control overhead per update; prints JSON.

Control overhead = the update's total time (accepted -> resumed, measured by the agent) minus the
raw load time (the slowest rank's own ``load`` timing: reading, manifest check, writing). It is
what the agent adds around the weight transfer: world size, manifest, pause, begin, finish,
agreement, state check, prefix-cache reset, resume, and the HTTP/RPC round trips between them.
Goal (issue 3): <= 1 s plus the drain wait; reported with and without the drain.

Backends:
    ``vllm`` (default): a real vLLM OpenAI server on CPU (tiny random Llama, dev mode, the
        weightroll extension) for each ``--tp``, driven by ``weightroll-agent`` as a subprocess.
    ``fake``: the in-process fake vLLM of ``tests/harness/fake_vllm.py`` (agent cost only).

Usage::

    .venv/bin/python bench/agent.py --tp 1 2 --repeats 5
    .venv/bin/python bench/agent.py --backend fake --ranks 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "tests" / "server", ROOT / "devtools"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

import aiohttp  # noqa: E402

from bench.machine import machine  # noqa: E402
from engine_agent.manifest import build_manifest, write_manifest  # noqa: E402

TOKEN = "bench-token"
GOAL_S = 1.0


async def _run_updates(
    http: aiohttp.ClientSession, agent_url: str, sources: list[Path], repeats: int, tag: str
) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    results = []
    for index in range(repeats + 1):  # the first one warms up (index build, page cache)
        source = sources[index % len(sources)]
        update_id = f"{tag}-{index}"
        body = {
            "id": update_id,
            "version": f"b{index}",
            "source": {"uri": str(source), "manifest": str(source / "weightroll-manifest.json")},
            "drain": {"mode": "wait", "timeoutSeconds": 30},
        }
        response = await http.post(f"{agent_url}/v1/updates", json=body, headers=headers)
        assert response.status == 202, await response.text()
        while True:
            status = await (
                await http.get(f"{agent_url}/v1/updates/{update_id}", headers=headers)
            ).json()
            if status["phase"] in ("Committed", "Failed", "Aborted"):
                break
            await asyncio.sleep(0.005)
        if status["phase"] != "Committed":
            raise RuntimeError(f"update {update_id} ended {status['phase']}: {status['verdict']}")
        if index:
            results.append(status)
    return results


def _summarise(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for status in statuses:
        timings = status["timings"]
        raw_load = max(rank["timings"].get("load", 0.0) for rank in status["ranks"])
        total = timings["total"]
        rows.append(
            {
                "total": total,
                "raw_load": raw_load,
                "drain": timings.get("drain", 0.0),
                "overhead": total - raw_load,
                "overhead_excl_drain": total - raw_load - timings.get("drain", 0.0),
                **{f"phase_{k}": v for k, v in timings.items() if k != "total"},
            }
        )
    keys = rows[0].keys()
    median = {key: round(statistics.median(row[key] for row in rows), 4) for key in keys}
    worst = round(max(row["overhead_excl_drain"] for row in rows), 4)
    return {
        "updates": len(rows),
        "median_s": median,
        "max_overhead_excl_drain_s": worst,
        "bytes_loaded_per_rank": statuses[-1]["ranks"][0]["bytesLoaded"],
        "ranks": len(statuses[-1]["ranks"]),
        "meets_goal": worst <= GOAL_S,
    }


async def bench_vllm(tp: int, repeats: int, work: Path, hidden: int) -> dict[str, Any]:
    from tests.harness.models import build_tiny_model, random_checkpoint
    from tests.server.vllm_server import AgentProcess, VllmServer

    overrides: dict[str, Any] = {}
    if hidden != 128:
        overrides = {"hidden_size": hidden, "intermediate_size": 2 * hidden}
    model = build_tiny_model("llama", work / "a", seed=0, **overrides)
    sources = [
        random_checkpoint(model, work / name, seed=seed) for name, seed in (("b", 1), ("c", 2))
    ]
    for source in sources:
        write_manifest(build_manifest(source), source / "weightroll-manifest.json")
    (work / "token").write_text(TOKEN)
    server = VllmServer(model=model, log=work / "vllm.log", tp=tp, boot_version="v0")
    await server.start()
    agent = AgentProcess(server.url, work / "token", work / "state", work / "agent.log")
    try:
        await agent.start()
        async with aiohttp.ClientSession() as http:
            while (await http.get(f"{agent.url}/readyz")).status != 200:
                await asyncio.sleep(0.2)
            statuses = await _run_updates(http, agent.url, sources, repeats, f"tp{tp}")
    finally:
        await agent.stop()
        await server.stop()
    summary = _summarise(statuses)
    summary["server_start_s"] = round(server.started_s, 1)
    return summary


async def bench_fake(ranks: int, repeats: int, work: Path) -> dict[str, Any]:
    import numpy as np
    from safetensors.numpy import save_file

    from engine_agent.sidecar import Agent, AgentConfig, TokenFile, create_app
    from tests.harness.fake_vllm import FakeVllm

    sources = []
    for name, seed in (("b", 1), ("c", 2)):
        path = work / name
        path.mkdir()
        rng = np.random.default_rng(seed)
        save_file(
            {"w": rng.standard_normal((256, 256), dtype=np.float32)}, str(path / "m.safetensors")
        )
        write_manifest(build_manifest(path), path / "weightroll-manifest.json")
        sources.append(path)
    (work / "token").write_text(TOKEN)
    fake = FakeVllm.tp(ranks, gen_seconds=0.0)
    await fake.start()
    agent = Agent(AgentConfig(vllm_url=fake.url, state_dir=work / "state"))
    runner = aiohttp.web.AppRunner(create_app(agent, TokenFile(work / "token")))
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            while (await http.get(f"{url}/readyz")).status != 200:
                await asyncio.sleep(0.05)
            statuses = await _run_updates(http, url, sources, repeats, "fake")
    finally:
        await runner.cleanup()
        await fake.stop()
    for status in statuses:  # the fake ranks report no timings: raw load is 0
        for rank in status["ranks"]:
            rank.setdefault("timings", {})
    return _summarise(statuses)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp.web  # noqa: F401  (used by bench_fake)

    report: dict[str, Any] = {
        "benchmark": "weightroll-agent control overhead per update",
        "backend": args.backend,
        "goal_overhead_excl_drain_s": GOAL_S,
        "repeats": args.repeats,
    }
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="weightroll-bench-agent-") as tmp:
        work = Path(tmp)
        if args.backend == "fake":
            report[f"fake_ranks{args.ranks}"] = await bench_fake(args.ranks, args.repeats, work)
        else:
            for tp in args.tp:
                (work / f"tp{tp}").mkdir()
                report[f"tp{tp}"] = await bench_vllm(
                    tp, args.repeats, work / f"tp{tp}", args.hidden
                )
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["machine"] = machine()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("vllm", "fake"), default="vllm")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ranks", type=int, default=4, help="fake backend: world size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128, help="vllm backend: hidden size")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(main_async(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
