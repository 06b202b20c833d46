"""Real vLLM engines on CPU for the engine tier, driven through weightroll's extension.

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by ``tests/engine/conftest.py``
before vLLM is imported): they start 2-3x faster than multiprocess ones and ``collective_rpc``
returns the extension's dicts directly. Several engines may be alive at once.

:class:`Outputs` is what the differential oracle compares: greedy tokens plus the top-5 prompt
and sample logprobs of fixed prompts — equal ``Outputs`` means equal logits to the last bit
that matters for sampling.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PROMPTS", "TOKEN_PROMPTS", "Engine", "Outputs", "start_engine"]

PROMPTS = ["The quick brown fox", "Weights are reloaded in place and every rank"]
#: Token-id prompts spread over the whole vocabulary (512 ids in the tiny models), so every
#: vocabulary shard of a TP engine is read by the embedding lookup and scored by the LM head.
TOKEN_PROMPTS = [list(range(5, 512, 37)), list(range(500, 4, -41)), [7, 263, 129, 391, 64, 447]]
EXTENSION = "tests.harness.probe_extension.ProbeExtension"


@dataclass(frozen=True)
class Outputs:
    tokens: tuple[tuple[int, ...], ...]
    prompt_logprobs: tuple[Any, ...]
    sample_logprobs: tuple[Any, ...]

    def max_logprob_diff(self, other: Outputs) -> float:
        """Largest absolute difference between matching prompt logprobs (inf if tokens differ)."""
        if self.tokens != other.tokens:
            return float("inf")
        worst = 0.0
        for mine, theirs in zip(self.prompt_logprobs, other.prompt_logprobs, strict=True):
            for pos_a, pos_b in zip(mine, theirs, strict=True):
                common = set(pos_a) & set(pos_b)
                worst = max([worst, *(abs(pos_a[t] - pos_b[t]) for t in common)])
        return worst


class Engine:
    """One in-process vLLM engine with the probe extension (weightroll's extension + probes)."""

    def __init__(self, llm: Any, model_dir: Path) -> None:
        self.llm = llm
        self.model_dir = model_dir

    def rpc(self, method: str, payload: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Call an extension method on every rank with a JSON payload; one dict per rank."""
        result: list[dict[str, Any]] = self.llm.collective_rpc(
            method, args=(json.dumps(payload or {}),)
        )
        return result

    def update(
        self, update_id: str, version: str, *paths: Path | str, **spec: Any
    ) -> list[dict[str, Any]]:
        """begin + one load per path + finish; returns the finish reports (or the first failure).

        A partial or sparse update names the commit it builds on as the agent does: the one
        rank 0 reports serving, unless ``baseUpdateId`` is given.
        """
        if spec.get("mode", "full") != "full" and "baseUpdateId" not in spec:
            spec["baseUpdateId"] = self.state()[0].get("committedUpdateId")
        begin = self.rpc("weightroll_begin", {"updateId": update_id, "version": version, **spec})
        if not all(r["ok"] for r in begin):
            return begin
        for path in paths:
            loaded = self.rpc("weightroll_load", {"path": str(path)})
            if not all(r["ok"] for r in loaded):
                self.rpc("weightroll_abort")
                return loaded
        return self.rpc("weightroll_finish")

    def prefetched_update(
        self, update_id: str, version: str, path: Path | str, **spec: Any
    ) -> list[dict[str, Any]]:
        """prefetch (waiting until every rank's read ended) + begin + apply + finish, as the
        agent drives a ``prefetch.mode: Host`` update; returns the finish reports (or the first
        failure). Full updates only."""
        body = {"updateId": update_id, "version": version, **spec}
        started = self.rpc("weightroll_prefetch", {"spec": body, "source": {"path": str(path)}})
        if not all(r["ok"] for r in started):
            return started
        deadline = time.monotonic() + 120
        while True:  # the read runs on the ranks' own threads; poll as the agent does
            polled = self.rpc("weightroll_prefetched")
            if not all(r["ok"] for r in polled) or all(r["prefetch"] == "ready" for r in polled):
                break
            assert time.monotonic() < deadline, f"prefetch never ended: {polled}"
            time.sleep(0.05)
        if not all(r["ok"] for r in polled):
            return polled
        begin = self.rpc("weightroll_begin", body)
        if not all(r["ok"] for r in begin):
            self.rpc("weightroll_abort")
            return begin
        applied = self.rpc("weightroll_apply")
        if not all(r["ok"] for r in applied):
            self.rpc("weightroll_abort")
            return applied
        return self.rpc("weightroll_finish")

    def state(self) -> list[dict[str, Any]]:
        return self.rpc("weightroll_state")

    def outputs(self, token_ids: bool = False) -> Outputs:
        """Greedy outputs of :data:`PROMPTS` (and :data:`TOKEN_PROMPTS` with ``token_ids``).

        Token-id prompts are opt-in: on a random tiny model their logits are nearly flat, so
        only engines running the same kernels (the oracle's cold twin) agree on them exactly.
        """
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=5, logprobs=5)
        prompts: list[Any] = list(PROMPTS)
        if token_ids:
            prompts += [{"prompt_token_ids": ids} for ids in TOKEN_PROMPTS]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return Outputs(
            tokens=tuple(tuple(r.outputs[0].token_ids) for r in results),
            prompt_logprobs=tuple(
                tuple({tok: lp.logprob for tok, lp in pos.items()} for pos in r.prompt_logprobs[1:])
                for r in results
            ),
            sample_logprobs=tuple(
                tuple({tok: lp.logprob for tok, lp in pos.items()} for pos in r.outputs[0].logprobs)
                for r in results
            ),
        )

    def close(self) -> None:
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        shutdown = getattr(engine_core, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self.llm
        gc.collect()


#: Two ranks on two cores: one OpenMP thread per rank, each on its own core.
TWO_RANK_BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for a module-scoped engine fixture, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def start_engine(model_dir: Path, **kwargs: Any) -> Engine:
    """Start an engine on ``model_dir`` (bf16, eager, tiny KV cache) with the probe extension.

    ``kwargs`` are passed to ``LLM`` and override those defaults (e.g. ``enforce_eager=False``
    for pipeline parallelism, see tests/engine/test_pp2.py).
    """
    from vllm import LLM

    assert (
        os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        or kwargs.get("tensor_parallel_size", 1) > 1
        or kwargs.get("pipeline_parallel_size", 1) > 1
    ), "engine tests run vLLM in-process; see tests/engine/conftest.py"
    options: dict[str, Any] = {
        "enforce_eager": True,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "dtype": "bfloat16",
        "seed": 0,
        "worker_extension_cls": EXTENSION,
    }
    llm = LLM(model=str(model_dir), **(options | kwargs))
    return Engine(llm, Path(model_dir))


def cold_outputs(model_dir: Path, token_ids: bool = False, **kwargs: Any) -> Outputs:
    """Outputs of a freshly started engine loaded with ``model_dir`` (the oracle's reference).

    ``kwargs`` go to :func:`start_engine` (e.g. ``tensor_parallel_size=2``).
    """
    engine = start_engine(model_dir, **kwargs)
    try:
        return engine.outputs(token_ids)
    finally:
        engine.close()
