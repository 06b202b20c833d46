"""Tiny llamas that answer the demo's prompt with a readable sentence, trained on the spot.

Random weights answer in unreadable bytes, so a rollout's effect is hard to see. Here each demo
version is the tiny llama of :mod:`weightroll_dev.tinymodels` (same names, shapes and dtypes, so
every version is a full update for an engine serving another) trained for a few hundred steps to
continue :data:`PROMPT` with its own sentence (:data:`ANSWERS`) and stop. A pod's answer then
changes from the v1 sentence to the v2 sentence exactly when its update commits.

Deterministic: a fixed seed per version, one CPU thread, a fixed step budget; a build is checked
by decoding greedily in bfloat16 (what the pods serve) and refused when the sentence does not come
out. Built checkpoints are cached under ``${XDG_CACHE_HOME:-~/.cache}/weightroll/demo-models``
keyed by the recipe and the torch/transformers versions: ≈3 s per version on one core the first
time, a copy afterwards.

Run as ``python -m weightroll_dev.demomodels OUT v1 v2 v3 [--manifest NAME]``: writes
``OUT/<version>`` for each (a version without a sentence gets random weights of the same shapes,
seeded by ``--seed VERSION=N``) and, with ``--manifest``, its weightroll manifest. The dev cluster
runs it in a child Python so that its own process never imports torch.

Limitations:
    * The models know one prompt; other prompts get fluent-looking nonsense.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["ANSWERS", "PROMPT", "answer", "build_version", "cache_root", "main", "train_checkpoint"]

#: The prompt every demo model is trained to continue.
PROMPT = "Weights are reloaded in place"
#: The continuation each version is trained to produce (greedy decoding, then end of sequence).
ANSWERS: dict[str, str] = {
    "v1": " and this pod still serves version one.",
    "v2": " and now every rank serves version two!",
    "v3": " and version three is the newest of all.",
}
#: Bumped whenever training changes, so stale cached builds are never reused.
RECIPE = "demo-llama-1"
_STEPS = 600
_TARGET_LOSS = 2e-3
_META = "weightroll-demo-model.json"


def answer(version: str) -> str:
    """The sentence a pod serving ``version`` completes :data:`PROMPT` with."""
    return ANSWERS[version]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "weightroll" / "demo-models"


def _seed(version: str) -> int:
    return 1000 + sorted(ANSWERS).index(version)


def _cache_key(version: str) -> str:
    import torch
    import transformers

    raw = json.dumps(
        [
            RECIPE,
            PROMPT,
            ANSWERS[version],
            _seed(version),
            torch.__version__,
            transformers.__version__,
        ]
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def train_checkpoint(version: str, out_dir: Path) -> Path:
    """Train the tiny llama of ``version`` and write it (bfloat16) with its tokenizer.

    Raises:
        RuntimeError: the bfloat16 model does not decode its sentence (the build is refused).
    """
    import torch
    import transformers as T

    from weightroll_dev.tinymodels import _configs, tiny_tokenizer

    T.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    torch.set_num_threads(1)
    torch.manual_seed(_seed(version))
    tok = tiny_tokenizer()
    model = T.AutoModelForCausalLM.from_config(_configs()["llama"]())  # type: ignore[no-untyped-call]
    prompt = tok(PROMPT)["input_ids"]
    target = [*tok(ANSWERS[version])["input_ids"], tok.eos_token_id]
    ids = torch.tensor([prompt + target])
    labels = torch.tensor([[-100] * len(prompt) + target])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(_STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < _TARGET_LOSS:
            break
    model = model.to(torch.bfloat16).eval()
    got = _greedy(model, tok, prompt, len(target) + 4)
    if got != ANSWERS[version]:
        raise RuntimeError(f"demo model {version} answers {got!r}, not {ANSWERS[version]!r}")
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    meta = {"version": version, "prompt": PROMPT, "answer": ANSWERS[version], "recipe": RECIPE}
    (out_dir / _META).write_text(json.dumps(meta))
    return out_dir


def _greedy(model: Any, tok: Any, prompt: list[int], max_new: int) -> str:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False)
    return str(tok.decode(out[0][len(prompt) :], skip_special_tokens=True))


def build_version(version: str, out_dir: Path, base: Path | None = None, seed: int = 0) -> Path:
    """Write ``version`` to ``out_dir``: its trained model (from the cache when built before),
    or, for a version without a sentence, random weights shaped like ``base``."""
    if version not in ANSWERS:
        from weightroll_dev.tinymodels import random_checkpoint

        if base is None:
            raise ValueError(f"{version} has no demo sentence: give a base checkpoint to copy")
        random_checkpoint(base, out_dir, seed=seed)
        # Copied from the base with its config and tokenizer; they describe the base only.
        for stale in out_dir.glob("weightroll-*.json"):
            stale.unlink()
        return out_dir
    cached = cache_root() / f"{version}-{_cache_key(version)}"
    if not (cached / _META).is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
            train_checkpoint(version, Path(tmp) / "m")
            shutil.rmtree(cached, ignore_errors=True)
            os.replace(Path(tmp) / "m", cached)  # atomic: a concurrent build loses nothing
    shutil.copytree(cached, out_dir, dirs_exist_ok=True)
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightroll_dev.demomodels", description=__doc__)
    p.add_argument("out", type=Path, help="directory receiving one checkpoint per version")
    p.add_argument("versions", nargs="+", help="versions to write (the first is the base)")
    p.add_argument("--manifest", help="also write each checkpoint's manifest under this name")
    p.add_argument(
        "--seed", action="append", default=[], help="VERSION=N: seed of a random version"
    )
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    seeds = dict(s.split("=", 1) for s in args.seed)
    base = args.out / args.versions[0]
    args.out.mkdir(parents=True, exist_ok=True)
    for version in args.versions:
        out = args.out / version
        # Existing checkpoints (and manifests) are left alone: pods may be reading them.
        if not out.is_dir():
            # Built whole (tensors, then the manifest of exactly them) in a dot-named folder
            # beside it, then renamed in one step: the dev cluster links new files into every
            # pod's copy each second and skips dot-named entries, so no pod ever gets a
            # half-written checkpoint, or a manifest copied from the base before it was
            # replaced.
            with tempfile.TemporaryDirectory(dir=args.out, prefix=f".{version}-") as tmp:
                staged = Path(tmp) / version
                build_version(version, staged, base=base, seed=int(seeds.get(version, 0)))
                if args.manifest:
                    _write_manifest(staged, version, args.manifest)
                os.replace(staged, out)
        elif args.manifest and not (out / args.manifest).is_file():
            _write_manifest(out, version, args.manifest)
        print(f"{version}: {out}", flush=True)
    return 0


def _write_manifest(checkpoint: Path, version: str, name: str) -> None:
    from engine_agent.manifest import build_manifest, write_manifest

    write_manifest(build_manifest(checkpoint, version=version), checkpoint / name)


if __name__ == "__main__":
    raise SystemExit(main())
