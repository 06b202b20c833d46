"""Start and stop a real vLLM OpenAI server on CPU (dev mode, weightroll extension) and the agent.

Used by ``tests/server`` and ``bench/agent.py``. Settings follow ../shared/design/vllm-on-cpu.md
§7: ``VLLM_SERVER_DEV_MODE=1``, 1 GiB KV cache, eager mode, bf16, loopback only; TP=2 binds one
OpenMP thread group per core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, §6). The server runs in its
own process group so that stopping it also stops its engine-core and worker processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.harness.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
#: The production extension; run-time failpoints come from ``WEIGHTROLL_FAILPOINTS_FILE``.
PROD_EXTENSION = "engine_agent.vllm_extension.WeightRollExtension"
TEST_EXTENSION = PROD_EXTENSION


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process."""

    model: Path
    log: Path
    tp: int = 1
    boot_version: str = "v0"
    extension: str = TEST_EXTENSION
    failpoints_file: Path | None = None
    port: int = field(default_factory=free_port)
    process: asyncio.subprocess.Process | None = None
    started_s: float = 0.0
    #: Extra server flags (e.g. ``--weight-transfer-config``).
    extra_args: list[str] = field(default_factory=list)
    #: Extra environment of the server (e.g. ``WEIGHTROLL_TRAINER_NETWORKS``).
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 300) -> None:
        env = dict(
            os.environ,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_LOGGING_LEVEL="INFO",
            PYTHONPATH=str(ROOT),
            WEIGHTROLL_BOOT_VERSION=self.boot_version,
            **self.extra_env,
        )
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.failpoints_file is not None:
            env["WEIGHTROLL_FAILPOINTS_FILE"] = str(self.failpoints_file)
        if self.tp > 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(self.tp))
        else:
            # vLLM's default binds every TP=1 server's worker to core 0 from its first
            # instruction (GOMP_CPU_AFFINITY), and an idle worker busy-waits for a second after
            # each call (the agent's guard calls every 0.5 s): with several servers up, a
            # starting one got a third of core 0 while core 1 idled and missed its start
            # timeout in CI. Let the OS place them (as the dev cluster does), one OpenMP thread
            # each as the binding gave them: the outputs stay batch-invariant (with two threads a
            # request batched with others took another greedy path than alone, and
            # test_agent_tp1's drain oracle compares the two).
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            env["OMP_NUM_THREADS"] = "1"
        args = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--enforce-eager",
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "4",
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--tensor-parallel-size",
            str(self.tp),
            "--worker-extension-cls",
            self.extension,
            *self.extra_args,
        ]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        handle = self.log.open("ab")
        began = time.monotonic()
        self.process = await asyncio.create_subprocess_exec(
            *args, env=env, stdout=handle, stderr=handle, start_new_session=True
        )
        handle.close()
        async with aiohttp.ClientSession() as http:
            while True:
                if self.process.returncode is not None:
                    raise RuntimeError(
                        f"vLLM exited with {self.process.returncode}; log:\n{self.tail()}"
                    )
                with contextlib.suppress(aiohttp.ClientError):
                    response = await http.get(f"{self.url}/health")
                    if response.status == 200:
                        break
                if time.monotonic() - began > timeout:
                    await self.stop()
                    raise TimeoutError(f"vLLM did not start in {timeout}s; log:\n{self.tail()}")
                await asyncio.sleep(0.5)
        self.started_s = time.monotonic() - began

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


@dataclass
class AgentProcess:
    """``weightroll-agent`` as a subprocess (so tests can SIGKILL it)."""

    vllm_url: str
    token_file: Path
    state_dir: Path
    log: Path
    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout: float = 30) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.log.parent.mkdir(parents=True, exist_ok=True)
        handle = self.log.open("ab")
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engine_agent.sidecar.main",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--vllm-url",
            self.vllm_url,
            "--token-file",
            str(self.token_file),
            "--state-dir",
            str(self.state_dir),
            *self.extra,
            env=env,
            stdout=handle,
            stderr=handle,
        )
        handle.close()
        began = time.monotonic()
        async with aiohttp.ClientSession() as http:
            while True:
                with contextlib.suppress(aiohttp.ClientError):
                    if (await http.get(f"{self.url}/healthz")).status == 200:
                        return
                if time.monotonic() - began > timeout:
                    raise TimeoutError("agent did not start")
                await asyncio.sleep(0.1)

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                await self.kill()


async def complete(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int = 8,
    **extra: Any,
) -> dict[str, Any]:
    """Greedy completion with per-token logprobs; returns the first choice."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "seed": 0,
    }
    body.update(extra)
    response = await http.post(f"{url}/v1/completions", json=body)
    assert response.status == 200, await response.text()
    choice: dict[str, Any] = (await response.json())["choices"][0]
    return choice
