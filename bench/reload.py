"""Benchmark: a verified full update versus a raw copy and versus vLLM's own reload.

Builds a ~160M-parameter random Llama-style model on CPU (bf16), starts one in-process vLLM
engine with weightroll's extension, and times, in the same run and on the same engine:

* ``raw_copy``: read the checkpoint (page-cached safetensors) and ``copy_`` every tensor into
  preallocated tensors of the same shapes — the floor for moving these bytes;
* ``vllm_reload``: vLLM's ``reload_weights(weights_path=...)`` (its layerwise reload);
* ``verified``: weightroll's begin/load/finish (coverage, identity, derived state), with every
  byte checked against a BLAKE3 manifest (``weightroll.manifest/v2``) as the loaders consume it;
* ``prefetch`` and ``window``: the same update prefetched (issue 30): ``prefetch`` is
  ``weightroll_prefetch`` until every rank reports ``ready`` (read, hashed and verified into
  host staging, routed, every module post-processed on a shadow and the seal's digests taken,
  while the engine serves); ``window`` is begin/apply/finish, what the drain must hold (the
  pause and resume around it are the agent's and not timed here). In
  ``prefetched_breakdown_seconds`` the ``prefetch_*`` steps ran before the drain:
  ``prefetch_prepare`` is the time the polls spent routing and post-processing (the engine
  does not step meanwhile), ``prefetch_post_load`` the post-load steps in it,
  ``prefetch_seal_digests`` the wait for the digests the commit's seal takes as known (taken on
  a thread of their own as each shadow is done: ``prefetch_seal_digests_overlapped``); the rest
  (``apply``: the shadows' copy into live storage and kernel hand-over; ``begin``;
  ``identity``) ran inside.

``host_pack_seconds``: what a CPU post-load step (oneDNN packing of eight MLP-sized weights)
takes on one thread, on every core, and on every core with one more busy thread beside it — on
a CPU device the prefetch's read, hash and seal-digest threads are that thread, so its
post-load steps run slower than vLLM's own reload runs them.

Each is repeated ``--rounds`` times alternating between two checkpoints; medians are reported
and compared as ratios (machines here are noisy, absolute seconds are not comparable across
runs). Prints exactly one JSON object on stdout; vLLM's logs (and anything else the process
prints) go to stderr. ``digest_share_of_verified`` is the hashing left on the critical path
(waiting for the hash workers at the end of the load); ``hash_overlapped_seconds`` is what the
workers spent hashing alongside the loaders.

Usage: ``.venv/bin/python bench/reload.py [--layers 6 --hidden 1024 --rounds 3]``
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "devtools"))  # tiny models

from bench.machine import machine
from engine_agent.reload.guard import DEFAULT_PERIOD_S

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STRUCTURAL = ("begin", "read_headers", "dry_run", "coverage", "identity")


def _json_stdout() -> Any:
    """Point fd 1 (and ``sys.stdout``) at stderr; return a stream on the real stdout.

    vLLM configures its log handler on stdout and C extensions write to fd 1 directly, so a
    redirect of ``sys.stdout`` alone is not enough.
    """
    real = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return real


def _guard_content_check(worker: Any) -> dict[str, Any]:
    """Run on the rank (``collective_rpc`` with a function): one forced still-true check."""
    engine = worker._weightroll_engine()
    started = time.perf_counter()
    problems = engine.guard.violations(force_content=True)
    return {"seconds": time.perf_counter() - started, "problems": len(problems)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    args = parser.parse_args()
    out = _json_stdout()

    import torch
    from safetensors import safe_open

    from engine_agent.manifest import build_manifest, write_manifest
    from tests.harness.engines import start_engine
    from tests.harness.models import build_tiny_model, random_checkpoint

    work = Path(tempfile.mkdtemp(prefix="weightroll-bench-"))
    # Two checkpoints of the model (about 0.6 GiB at the defaults): never left behind.
    atexit.register(shutil.rmtree, work, ignore_errors=True)
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
    files = {p: sorted(p.glob("*.safetensors")) for p in (a, b)}
    manifests = {}
    for path in (a, b):
        manifests[path] = path / "weightroll-manifest.json"
        write_manifest(build_manifest(path, version=f"v-{path.name}"), manifests[path])
    n_params = 0
    with safe_open(str(files[a][0]), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            n_params += int(torch.Size(handle.get_slice(name).get_shape()).numel())
    engine = start_engine(a)

    def raw_copy(path: Path) -> float:
        started = time.perf_counter()
        for file in files[path]:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118
                    tensor = handle.get_tensor(name)
                    destinations[name].copy_(tensor)
        return time.perf_counter() - started

    def vllm_reload(path: Path) -> float:
        started = time.perf_counter()
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        return time.perf_counter() - started

    counter = iter(range(10_000))

    def prefetched(path: Path) -> tuple[float, float, dict[str, float]]:
        update = {"updateId": f"bench-{next(counter)}", "version": f"v-{path.name}"}
        source = {"path": str(path), "manifest": str(manifests[path])}
        started = time.perf_counter()
        report = engine.rpc("weightroll_prefetch", {"spec": update, "source": source})[0]
        assert report["ok"], report
        while report["prefetch"] != "ready":  # the read runs on the rank's own thread
            time.sleep(0.002)
            report = engine.rpc("weightroll_prefetched")[0]
            assert report["ok"], report
        ready = time.perf_counter()
        for method, payload in (
            ("weightroll_begin", update),
            ("weightroll_apply", {}),
            ("weightroll_finish", {}),
        ):
            report = engine.rpc(method, payload)[0]
            assert report["ok"], report
        done = time.perf_counter()
        assert report["manifestDigest"] and report["digest"], report
        return ready - started, done - ready, report["timings"]

    def verified(path: Path) -> tuple[float, dict[str, float]]:
        started = time.perf_counter()
        update = {"updateId": f"bench-{next(counter)}", "version": f"v-{path.name}"}
        for method, payload in (
            ("weightroll_begin", update),
            ("weightroll_load", {"path": str(path), "manifest": str(manifests[path])}),
            ("weightroll_finish", {}),
        ):
            report = engine.rpc(method, payload)[0]
            assert report["ok"], report
        elapsed = time.perf_counter() - started
        assert report["manifestDigest"] and report["digest"], report
        return elapsed, report["timings"]

    with safe_open(str(files[a][0]), framework="pt") as handle:
        destinations = {n: torch.empty_like(handle.get_tensor(n)) for n in handle.keys()}  # noqa: SIM118

    # Warm-up: page cache, allocator, first-call costs.
    for path in (b, a):
        raw_copy(path), vllm_reload(path), verified(path)
    prefetched(b), prefetched(a)

    results: dict[str, list[float]] = {
        "raw_copy": [],
        "vllm_reload": [],
        "verified": [],
        "prefetch": [],
        "window": [],
    }
    breakdowns: list[dict[str, float]] = []
    window_breakdowns: list[dict[str, float]] = []
    for i in range(args.rounds * 2):
        path = b if i % 2 == 0 else a
        results["raw_copy"].append(raw_copy(path))
        results["vllm_reload"].append(vllm_reload(path))
        seconds, timings = verified(path)
        results["verified"].append(seconds)
        breakdowns.append(timings)
        # the same full update again, prefetched (same bytes moved, same checks)
        ahead, window, window_timings = prefetched(path)
        results["prefetch"].append(ahead)
        results["window"].append(window)
        window_breakdowns.append(window_timings)
    # The still-true guard's content check on the last commit (issue 26 E): what one period
    # costs the rank (identity checks on every state answer read no byte and are not timed).
    guard_seconds = []
    for _ in range(3):
        (check,) = engine.llm.collective_rpc(_guard_content_check)
        assert check["problems"] == 0, check
        guard_seconds.append(check["seconds"])
    out_ok = engine.outputs()  # the engine still serves after all of it
    engine.close()
    hashing = _hash_throughput(destinations["model.embed_tokens.weight"])
    contention = _host_contention(args.hidden)

    median = {k: statistics.median(v) for k, v in results.items()}
    steps = {k: statistics.median(t.get(k, 0.0) for t in breakdowns) for k in breakdowns[0]}
    structural = sum(steps.get(k, 0.0) for k in STRUCTURAL)
    report: dict[str, Any] = {
        "model": {"params": n_params, "bytes": n_params * 2, **shape},
        "rounds": args.rounds * 2,
        "median_seconds": {k: round(v, 4) for k, v in median.items()},
        "ratios": {
            "verified_vs_vllm_reload": round(median["verified"] / median["vllm_reload"], 3),
            "verified_vs_raw_copy": round(median["verified"] / median["raw_copy"], 3),
            "vllm_reload_vs_raw_copy": round(median["vllm_reload"] / median["raw_copy"], 3),
            "structural_checks_share_of_verified": round(structural / median["verified"], 4),
            "digest_share_of_verified": round(
                (steps.get("hash_wait", 0.0) + steps.get("digest", 0.0)) / median["verified"], 4
            ),
            "hash_overlapped_share_of_verified": round(
                steps.get("hash_overlapped", 0.0) / median["verified"], 4
            ),
            "prefetch_vs_vllm_reload": round(median["prefetch"] / median["vllm_reload"], 3),
            "window_vs_vllm_reload": round(median["window"] / median["vllm_reload"], 3),
            "prefetch_plus_window_vs_vllm_reload": round(
                (median["prefetch"] + median["window"]) / median["vllm_reload"], 3
            ),
        },
        "verified_breakdown_seconds": {k: round(v, 4) for k, v in sorted(steps.items())},
        "where_verified_goes_seconds": _where(steps, structural),
        # the prefetched update's steps (prefetch_* ran before the drain, the rest inside it)
        "prefetched_breakdown_seconds": {
            k: round(statistics.median(t.get(k, 0.0) for t in window_breakdowns), 4)
            for k in sorted(window_breakdowns[0])
        },
        "hash_throughput_gb_per_s": hashing,
        "host_pack_seconds": contention,
        "still_true_guard": {
            "content_check_seconds": round(statistics.median(guard_seconds), 4),
            "period_seconds": DEFAULT_PERIOD_S,
            "share_of_serving_time": round(statistics.median(guard_seconds) / DEFAULT_PERIOD_S, 5),
            "goal_share": "<= 0.01",
        },
        "verification": "every tensor BLAKE3-checked against a weightroll.manifest/v2 as loaded",
        "goals": {
            "verified_vs_vllm_reload": "<= 1.1",
            "structural_checks_share": "<= 0.05",
            "window_vs_vllm_reload": "<= 0.5",
            "prefetch_plus_window_vs_vllm_reload": "<= 1.0",
        },
        "engine_serves_after": bool(out_ok.tokens),
        "machine": machine(),
    }
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    out.write(text + "\n")
    out.flush()


def _hash_throughput(tensor: Any) -> dict[str, float]:
    """GB/s of the two tensor digests on this CPU (the embedding, best of 3)."""
    from engine_agent.reload.digest import fingerprint, tensor_digest

    result = {}
    for name, digest in (("blake3_host", tensor_digest), ("device_fingerprint", fingerprint)):
        best = min(_seconds(digest, tensor) for _ in range(3))
        result[name] = round(tensor.numel() * tensor.element_size() / best / 1e9, 2)
    return result


def _host_contention(hidden: int) -> dict[str, float] | None:
    """What one thread beside the engine's OpenMP team costs it on this CPU.

    Packs eight MLP-sized weights for vLLM's oneDNN GEMM (what a CPU post-load step does) on one
    thread, on every core, and on every core while one more thread hashes (as the prefetch's
    read, hash and seal-digest threads do beside the post-load). Best of 3 seconds each; ``None``
    where vLLM's CPU build has no oneDNN kernels, or oneDNN has no bf16 matmul on this CPU (an
    AVX2 one without AVX512-BF16 refuses the primitive; vLLM does not pack bf16 there either)."""
    import threading

    import blake3
    import torch

    try:
        from vllm import _custom_ops as ops

        pack = ops.create_onednn_mm
    except (ImportError, AttributeError):
        return None
    weights = [torch.randn(4 * hidden, hidden).to(torch.bfloat16) for _ in range(8)]
    busy = bytes(64 << 20)
    stop = threading.Event()

    def hashing() -> None:
        while not stop.is_set():
            blake3.blake3(busy, max_threads=1).digest()

    def best(threads: int) -> float:
        torch._C.set_num_threads(threads)  # vLLM's CPU worker replaces torch.set_num_threads
        return round(
            min(_seconds(lambda ws: [pack(w.t(), 32) for w in ws], weights) for _ in range(3)), 4
        )

    cores = torch.get_num_threads()
    try:
        result = {"one_thread": best(1), "all_threads": best(cores)}
    except RuntimeError:  # "could not create a primitive descriptor for the matmul primitive"
        torch._C.set_num_threads(cores)
        return None
    beside = threading.Thread(target=hashing, daemon=True)
    beside.start()
    try:
        result["all_threads_beside_one_busy_thread"] = best(cores)
    finally:
        stop.set()
        beside.join()
        torch._C.set_num_threads(cores)
    result["threads"] = cores
    return result


def _seconds(function: Any, argument: Any) -> float:
    started = time.perf_counter()
    function(argument)
    return time.perf_counter() - started


def _where(steps: dict[str, float], structural: float) -> dict[str, float]:
    """The verified update split into disjoint parts (``load`` contains the module steps)."""
    inside = ("post_load", "refresh_derived", "copy_live", "hash_wait")
    parts = {k: steps.get(k, 0.0) for k in inside}
    parts["loaders_into_staging"] = steps.get("load", 0.0) - sum(parts.values())
    parts["structural_checks"] = structural
    parts["finish_other"] = max(
        0.0, steps.get("finish", 0.0) - steps.get("coverage", 0.0) - steps.get("identity", 0.0)
    )
    return {k: round(v, 4) for k, v in parts.items()}


if __name__ == "__main__":
    main()
