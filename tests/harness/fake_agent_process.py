"""``python -m tests.harness.fake_agent_process``: one :class:`FakeAgent` as a process.

The container of a cheap simulated pod (tests/e2e RBAC and simulator tests): the pod simulator
runs it like the real ``weightroll-agent`` — same flags for host, port and token file — so a
fleet of pods can be rolled out in seconds without vLLM. Updates "load" by sleeping; every
version succeeds unless named in ``--fail``. Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

from tests.harness.fake_agent import FakeAgent


async def _serve(args: argparse.Namespace) -> None:
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    agent = FakeAgent(
        pod=args.pod,
        host=args.host,
        port=args.port,
        token=token,
        version=args.initial_version,
        source=args.initial_source,
        step=args.step,
        scripts=dict.fromkeys(args.fail, "fail"),
        request_log=Path(args.request_log) if args.request_log else None,
    )
    await agent.appear()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await agent.close()


def main() -> None:
    p = argparse.ArgumentParser(prog="fake_agent_process")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8470)
    p.add_argument("--token-file")
    p.add_argument("--pod", default="pod")
    p.add_argument("--initial-version", default="v1")
    p.add_argument("--initial-source", default="file:///models/v1")
    p.add_argument("--step", type=float, default=0.05)
    p.add_argument("--fail", action="append", default=[], help="versions whose update fails")
    p.add_argument("--request-log", help="append every /v1 request to this file")
    asyncio.run(_serve(p.parse_args()))


if __name__ == "__main__":
    main()
