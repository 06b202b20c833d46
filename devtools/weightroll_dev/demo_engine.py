"""``weightroll_dev demo --engine``: a verified in-place update on a real vLLM engine, here.

What it shows, on one replica (a real vLLM CPU engine with weightroll's worker extension):

1. a tiny random model "A" is generated and served; a prompt is answered;
2. a new checkpoint "B" is rolled in place: every shard is accounted for, every module is
   processed and verified, and only then the engine reports clean at version B — the answer
   changes exactly at the commit;
3. the failure the project exists for (``--scenario fail``, or both with ``all``): an update
   that sends ``q`` but not ``k``/``v`` of one layer is refused at finish with the missing
   shards named; the engine is *poisoned* (it must not serve); an empty begin/finish does not
   clear it; only a complete full update does.

The cluster version of the demo (operator, three pods, rollout view) builds on this and lives
with the operator; this command needs nothing but the virtual environment.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

PROMPT = "The quick brown fox"


def _say(step: str, detail: str = "") -> None:
    print(f"\033[1m==> {step}\033[0m" + (f"  {detail}" if detail else ""), flush=True)


def _show(report: dict[str, Any]) -> None:
    keys = ("ok", "state", "version", "required", "received", "modulesProcessed", "missing")
    shown = {k: report.get(k) for k in keys if report.get(k) not in (None, [], "")}
    missing: list[str] = report.get("missing") or []
    if len(missing) > 4:
        shown["missing"] = [*missing[:4], f"... {report['missingCount'] - 4} more"]
    if report.get("error"):
        shown["error"] = f"{report['error']['code']}: {report['error']['message']}"
    print("    " + json.dumps(shown), flush=True)


class _Replica:
    def __init__(self, model_dir: Path) -> None:
        from vllm import LLM, SamplingParams

        self.llm = LLM(
            model=str(model_dir),
            enforce_eager=True,
            max_model_len=256,
            max_num_seqs=4,
            dtype="bfloat16",
            worker_extension_cls="engine_agent.vllm_extension.WeightRollExtension",
        )
        self.params = SamplingParams(max_tokens=12, temperature=0)

    def ask(self) -> str:
        out = self.llm.generate([PROMPT], self.params, use_tqdm=False)[0].outputs[0]
        return f"{PROMPT!r} -> tokens {list(out.token_ids)}"

    def rpc(self, method: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.llm.collective_rpc(method, args=(json.dumps(payload or {}),))[
            0
        ]
        return result

    def update(self, update_id: str, version: str, path: Path) -> dict[str, Any]:
        begin = self.rpc("weightroll_begin", {"updateId": update_id, "version": version})
        if not begin["ok"]:
            return begin
        loaded = self.rpc("weightroll_load", {"path": str(path)})
        if not loaded["ok"]:
            return loaded
        return self.rpc("weightroll_finish")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weightroll_dev demo --engine",
        description="Roll a verified in-place weight update through a real vLLM engine on CPU, "
        "then show a half-sent update refused (make demo-engine). Without --engine, `weightroll "
        "demo` runs the cluster demo (`python -m weightroll_dev demo --help`).",
    )
    parser.add_argument(
        "--scenario",
        choices=("ok", "fail", "all"),
        default="all",
        help="ok: a verified update; fail: a half-sent update is refused and poisons; all: both",
    )
    parser.add_argument(
        "--workdir", type=Path, help="where to write the models (default: a temp dir)"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("WEIGHTROLL_BOOT_VERSION", "a")
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            "python -m weightroll_dev demo --engine: vLLM is not installed; "
            "run `make demo-engine` (it installs it)",
            file=sys.stderr,
        )
        return 2

    from weightroll_dev.tinymodels import build_tiny_model, random_checkpoint, write_subset

    started = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="weightroll-demo-"))
    _say("Generating tiny random checkpoints A and B", str(work))
    a = build_tiny_model("llama", work / "a", seed=0)
    b = random_checkpoint(a, work / "b", seed=1)

    _say("Starting a real vLLM engine on A with the weightroll worker extension (~10-30 s)")
    replica = _Replica(a)
    _say("State", json.dumps(replica.rpc("weightroll_state")))
    _say("Answer on A", replica.ask())

    failures = 0
    if args.scenario in ("ok", "all"):
        _say("Rolling B in place: begin -> load -> finish (verified on every rank)")
        report = replica.update("demo-b", "b", b)
        _show(report)
        failures += not report["ok"]
        _say("Answer on B (changed exactly at the commit)", replica.ask())

    if args.scenario in ("fail", "all"):
        base = "b" if args.scenario == "all" else "a"
        other = a if base == "b" else b
        _say("Sending an update whose layer 0 has q but not k/v (gap 2 of the mission)")
        half = write_subset(
            other,
            work / "q-only.safetensors",
            lambda n: (
                not n.startswith(
                    ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj")
                )
            ),
        )
        report = replica.update("demo-q-only", "c", half)
        if report.get("error"):
            report["error"]["message"] = report["error"]["message"][:160]
        _show(report)
        failures += report["ok"]  # it must be refused
        state = replica.rpc("weightroll_state")
        _say("Engine state after the refused update", json.dumps(state))
        _say("An empty begin/finish must not re-enable serving (gap 1)")
        replica.rpc("weightroll_begin", {"updateId": "demo-empty", "version": "c"})
        _show(replica.rpc("weightroll_finish"))
        _say("Recovering with a complete full update back to " + base)
        report = replica.update("demo-recover", base, a if base == "a" else b)
        _show(report)
        failures += not report["ok"]
        _say("Answer after recovery", replica.ask())

    _say(
        "Done" if not failures else "Done, with unexpected results",
        f"{time.perf_counter() - started:.1f} s; final state "
        + json.dumps(replica.rpc("weightroll_state")),
    )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
