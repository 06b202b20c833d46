"""The prepared GPU check (issue 26 G): one command, one JSON object, at most ~8 minutes on a GPU.

For a dense (Llama) and a MoE (Qwen2-MoE) tiny model built here (no downloads), on one device:

1. cold engines on B, and on P (B with a sparse patch of the final norm), give the reference
   censuses (tests/harness/census.py: every tensor the kernels read, byte for byte);
2. a warm engine starts on A — on a GPU with CUDA graphs captured (``enforce_eager=False``) —
   and is updated A->B (full, verified) and then B->P (sparse patch);
3. after each update its census must equal the cold one, and nothing a captured graph holds
   an address of (parameters, buffers, module tensors) may have moved;
4. the device fingerprint (``engine_agent.reload.digest.fingerprint``) is timed over 1 GiB on
   the device (64 MiB on the CPU): GB/s; and one content check of the still-true guard over
   each model's weights (its share of serving time at the default period).

``--dry-run`` runs the same steps on the CPU in eager mode (CI runs it: tests/engine/
test_gpu_check.py), so the script cannot rot on machines without a GPU; ``"device"`` in the
output says which it was, and ``"passed"`` is the verdict. Usage::

    .venv/bin/python bench/gpu_check.py            # on a machine with one GPU (make gpu-check)
    .venv/bin/python bench/gpu_check.py --dry-run  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for extra in (ROOT, ROOT / "devtools"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.machine import machine  # noqa: E402

MODELS = {"dense": "llama", "moe": "qwen2_moe"}


def _json_stdout() -> Any:
    """Point fd 1 at stderr (vLLM logs to stdout); return a stream on the real stdout."""
    real = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return real


def _patched(b: Path, out: Path) -> tuple[Path, Path]:
    """P = B with every third element of the final norm rewritten; and that sparse patch."""
    import shutil

    import torch
    from weightroll_dev.tinymodels import load_tensors, write_tensors

    from engine_agent.reload.sparse import write_patch

    tensors = load_tensors(b)
    norm = tensors["model.norm.weight"]
    index = torch.arange(0, norm.numel(), 3)
    values = (torch.randn(index.numel(), generator=torch.Generator().manual_seed(5)) * 0.3).to(
        norm.dtype
    )
    patched = norm.clone()
    patched.view(-1)[index] = values
    shutil.copytree(b, out / "p")
    write_tensors(out / "p" / "model.safetensors", tensors | {"model.norm.weight": patched})
    patch = write_patch(
        out / "norm.patch.safetensors",
        "b",
        {"model.norm.weight": (tuple(norm.shape), index, values)},
    )
    return out / "p", patch


def _census(engine: Any) -> dict[str, Any]:
    (only,) = engine.llm.collective_rpc("probe_census")
    return dict(only)


def _check_model(kind: str, work: Path, options: dict[str, Any]) -> dict[str, Any]:
    from weightroll_dev.tinymodels import build_tiny_model, random_checkpoint

    from tests.harness.census import differences, moved
    from tests.harness.engines import start_engine

    a = build_tiny_model(kind, work / "a", seed=0)
    b = random_checkpoint(a, work / "b", seed=1)
    p, patch = _patched(b, work)
    cold: dict[str, dict[str, Any]] = {}
    for label, path in (("b", b), ("p", p)):
        engine = start_engine(path, **options)
        try:
            cold[label] = _census(engine)
        finally:
            engine.close()
    result: dict[str, Any] = {}
    started = time.perf_counter()
    warm = start_engine(a, **options)
    result["warm_start_s"] = round(time.perf_counter() - started, 2)
    try:
        boot = _census(warm)
        t0 = time.perf_counter()
        full = warm.update("gpu-check-full", "b", b)
        result["full_update_s"] = round(time.perf_counter() - t0, 3)
        after_full = _census(warm)
        t0 = time.perf_counter()
        sparse = warm.update("gpu-check-sparse", "p", patch, mode="sparse", baseVersion="b")
        result["sparse_update_s"] = round(time.perf_counter() - t0, 3)
        after_sparse = _census(warm)
        (cost,) = warm.llm.collective_rpc("probe_guard_cost")
    finally:
        warm.close()
    result["committed"] = all(r["ok"] for r in full) and all(r["ok"] for r in sparse)
    result["census_tensors"] = len(boot)
    result["full_equals_cold"] = differences(after_full, cold["b"])[:5]
    result["sparse_equals_cold"] = differences(after_sparse, cold["p"])[:5]
    result["graph_addresses_moved"] = (moved(boot, after_full) + moved(boot, after_sparse))[:5]
    result |= cost
    result["passed"] = (
        result["committed"]
        and not result["full_equals_cold"]
        and not result["sparse_equals_cold"]
        and not result["graph_addresses_moved"]
    )
    return result


def _fingerprint_throughput(device: Any, nbytes: int) -> float:
    """GB/s of :func:`~engine_agent.reload.digest.fingerprint` over one large tensor."""
    import torch

    from engine_agent.reload.digest import fingerprint

    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device).view(torch.bfloat16)
    fingerprint(data)  # warm-up (kernels, allocator)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        fingerprint(data)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return round(3 * nbytes / (time.perf_counter() - started) / 1e9, 2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--out", type=Path, help="also write the JSON object here")
    args = parser.parse_args()
    out = _json_stdout()
    import torch

    on_gpu = torch.cuda.is_available() and not args.dry_run
    if not on_gpu and not args.dry_run:
        print("no GPU here: run with --dry-run (the same steps on the CPU)", file=sys.stderr)
        return 2
    # On a GPU the warm engine captures CUDA graphs: their addresses must survive the update.
    options: dict[str, Any] = {"enforce_eager": not on_gpu}
    report: dict[str, Any] = {
        "benchmark": "weightroll prepared GPU check (issue 26 G)",
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu (dry run)",
        "dryRun": not on_gpu,
        "cudaGraphs": on_gpu,
        "machine": machine(),
    }
    report["fingerprint_gb_per_s"] = _fingerprint_throughput(
        torch.device("cuda" if on_gpu else "cpu"), (1 << 30) if on_gpu else (64 << 20)
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="weightroll-gpu-check-") as tmp:
        for name in args.models:
            work = Path(tmp) / name
            work.mkdir()
            report[name] = _check_model(MODELS[name], work, options)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["passed"] = all(report[name]["passed"] for name in args.models)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    out.write(text + "\n")
    out.flush()
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
