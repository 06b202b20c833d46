"""Container processes of simulated pods: start in their own process group, stop the whole group.

A container here is one subprocess (vLLM's API server forks an engine core and workers, so the
process group — not the PID — is what gets signalled). Output goes to a log file per container
and start; nothing is read from pipes, so a chatty server can never block on a full pipe.

Invariants:
    * :meth:`ContainerProcess.stop` always returns with the group gone: SIGTERM, a bounded wait,
      then SIGKILL of the group.
    * Every wait is bounded; nothing here sleeps without a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ContainerProcess"]


@dataclass(slots=True)
class ContainerProcess:
    """One container's process (group) and its log.

    Args:
        name: container name (for messages).
        argv: the command line, already resolved (absolute executable).
        env: the complete environment.
        log: file that receives stdout and stderr (appended).
    """

    name: str
    argv: Sequence[str]
    env: Mapping[str, str]
    log: Path
    process: asyncio.subprocess.Process | None = None
    #: Wall-clock time of the last start (seconds since the epoch).
    started_at: float = 0.0
    #: Exit status of the last run once it ended, else ``None``.
    exit_code: int | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def start(self) -> None:
        """Start the process in a new session (its own process group)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as handle:
            handle.write(f"\n==== start {' '.join(self.argv)}\n".encode())
            handle.flush()
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                env=dict(self.env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=handle,
                stderr=handle,
                start_new_session=True,
            )
        self.started_at = time.time()
        self.exit_code = None

    def poll(self) -> int | None:
        """Return the exit status if the process ended (records it), else ``None``."""
        if self.process is not None and self.process.returncode is not None:
            self.exit_code = self.process.returncode
        return self.exit_code

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, wait up to ``grace`` seconds, then SIGKILL it."""
        process = self.process
        if process is None:
            return
        pgid = process.pid
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), grace)
        # Children (vLLM's engine core and workers) may outlive the leader: kill the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), 10)
        self.poll()

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log (for error messages)."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"
