"""Benchmark: a verified trainer push versus the same transport feeding vLLM's stock reload.

Builds a random Llama-style model on CPU (bf16), starts one in-process vLLM engine with
weightroll's extension and a ``weightroll_gloo``-based backend, and pushes full checkpoints to
it from a trainer thread (``GlooTrainerWeightTransferEngine``, the production trainer side):

* ``verified``: the production lifecycle — start opens the verified session, every received
  batch goes through coverage/staging/processing, finish verifies and commits;
* ``stock``: the same Gloo receive feeding ``model.load_weights`` inside vLLM's layerwise reload
  (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), i.e. what vLLM's own NCCL
  engine does with the bytes.

One run, alternating stock/verified and the two checkpoints, ``--rounds`` pairs; medians are
compared as a ratio (goal: verified / stock <= 1.1). One JSON object on stdout; logs on stderr.

Usage: ``.venv/bin/python bench/trainer.py [--layers 6 --hidden 1024 --rounds 3]``
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# One JSON object on stdout: everything else (vLLM logs to stdout) goes to stderr.
_STDOUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devtools"))  # tiny models

from bench.machine import machine  # noqa: E402 (after the path set-up)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
#: The worker's trainer networks: the bench's trainer rendezvous on loopback.
os.environ.setdefault("WEIGHTROLL_TRAINER_NETWORKS", "127.0.0.1/32")

BACKEND = "weightroll_bench_gloo"
#: Which lifecycle the bench backend runs next (the engine runs in this process).
MODE = {"stock": False}


def _register_bench_backend() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from engine_agent.transfer.gloo import GlooWeightTransferEngine

    class BenchGloo(GlooWeightTransferEngine):
        """``weightroll_gloo``, or the same receive under vLLM's layerwise reload (stock)."""

        def start_weight_update(self) -> None:
            if MODE["stock"]:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
            else:
                super().start_weight_update()

        def finish_weight_update(self) -> None:
            if MODE["stock"]:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model, self.model_config)
            else:
                super().finish_weight_update()

        def _feed(self, batch: list[Any]) -> BaseException | None:
            if MODE["stock"]:
                self.model.load_weights(batch)
                return None
            return super()._feed(batch)

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, BenchGloo)


class LocalClient:
    """``VLLMWeightSyncClient`` over the in-process ``LLM`` (vLLM's offline RL methods)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from engine_agent.trainer import CheckpointSource
    from engine_agent.transfer.gloo import GlooTrainerInitInfo, free_port
    from tests.harness.engines import start_engine
    from tests.harness.models import build_tiny_model, random_checkpoint

    _register_bench_backend()
    work = Path(tempfile.mkdtemp(prefix="weightroll-bench-trainer-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # the checkpoints: never left behind
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        vocab_size=args.vocab,
    )
    a = build_tiny_model("llama", work / "a", seed=0, **shape)
    b = random_checkpoint(a, work / "b", seed=1)
    sources = {path: CheckpointSource(path) for path in (a, b)}
    n_params = sum(math.prod(m.shape) for m in sources[a].metadata())
    engine = start_engine(a, weight_transfer_config={"backend": BACKEND})
    client = LocalClient(engine.llm)
    info = GlooTrainerInitInfo(
        master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0
    )
    # Tensors are materialised once per checkpoint: the bench times the transport and the
    # lifecycle, not safetensors reads.
    cached = {path: list(source) for path, source in sources.items()}

    class Cached(CheckpointSource):
        def __init__(self, path: Path) -> None:
            self.__dict__.update(sources[path].__dict__)
            self._pairs = cached[path]

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(self._pairs)

    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=Cached(a))
    counter = iter(range(10_000))

    breakdowns: list[dict[str, float]] = []

    def push(path: Path, stock: bool) -> float:
        MODE["stock"] = stock
        trainer.source = Cached(path)
        started = time.perf_counter()
        trainer.send_weights(weight_version=f"bench-{next(counter)}")  # type: ignore[call-arg]
        elapsed = time.perf_counter() - started
        if not stock:
            (report,) = engine.rpc("weightroll_transfer_report")
            assert report["ok"] and report["call"] == "finish", report
            breakdowns.append(report["timings"])
        return elapsed

    for path in (b, a):  # warm-up: allocator, first-call costs, both lifecycles
        push(path, stock=True), push(path, stock=False)
    breakdowns.clear()
    results: dict[str, list[float]] = {"stock": [], "verified": []}
    for i in range(args.rounds * 2):
        path = b if i % 2 == 0 else a
        order = ("stock", "verified") if i % 4 < 2 else ("verified", "stock")
        for mode in order:
            results[mode].append(push(path, stock=mode == "stock"))
    state = engine.rpc("weightroll_state")[0]
    serves = bool(engine.outputs().tokens)
    engine.close()
    median = {k: statistics.median(v) for k, v in results.items()}
    steps = {k: statistics.median(t.get(k, 0.0) for t in breakdowns) for k in breakdowns[0]}
    report: dict[str, Any] = {
        "model": {"params": n_params, "bytes": n_params * 2, **shape},
        "rounds": args.rounds * 2,
        "transport": "weightroll_gloo (loopback TCP, one worker rank)",
        "median_seconds": {k: round(v, 4) for k, v in median.items()},
        "all_seconds": {k: [round(x, 4) for x in v] for k, v in results.items()},
        "ratios": {"verified_vs_stock": round(median["verified"] / median["stock"], 3)},
        # Per-step seconds of the verified session on the rank (medians; steps overlap the
        # receive, so they do not add up to the push).
        "verified_breakdown_seconds": {k: round(v, 4) for k, v in sorted(steps.items())},
        "goals": {"verified_vs_stock": "<= 1.1"},
        "final_rank_state": {"state": state["state"], "version": state["version"]},
        "engine_serves_after": serves,
        "machine": machine(),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text, file=_STDOUT, flush=True)


if __name__ == "__main__":
    main()
