"""The demo's checkpoints (issue 13 H): each trained version says its own readable sentence, and a
version without one is a full random update with its own manifest (never the base's).

Needs torch and transformers (no vLLM); the trained models come from the build cache after the
first run (≈3 s each on one core the first time).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from weightroll_dev import demomodels
from weightroll_dev.tinymodels import build_tiny_model

MANIFEST = "weightroll-manifest.json"


def _greedy(model_dir: Path) -> str:
    import torch
    import transformers as T

    tok = T.AutoTokenizer.from_pretrained(model_dir)
    model = T.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    prompt = tok(demomodels.PROMPT)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)
    return str(tok.decode(out[0][len(prompt) :], skip_special_tokens=True))


def test_versions_answer_their_own_readable_sentences(tmp_path: Path) -> None:
    answers = {}
    for version in ("v1", "v2"):
        out = demomodels.build_version(version, tmp_path / version)
        answers[version] = _greedy(out)
        assert answers[version] == demomodels.answer(version)
    assert answers["v1"] != answers["v2"]
    assert all(a.strip().isascii() and " " in a.strip() for a in answers.values())


def test_a_version_without_a_sentence_gets_random_weights_and_its_own_manifest(
    tmp_path: Path,
) -> None:
    base = build_tiny_model("llama", tmp_path / "v1", seed=0)
    from engine_agent.manifest import build_manifest, write_manifest

    write_manifest(build_manifest(base, version="v1"), base / MANIFEST)
    before = (base / MANIFEST).read_text()
    code = demomodels.main([str(tmp_path), "v1", "v9", "--seed=v9=3", f"--manifest={MANIFEST}"])
    assert code == 0
    v1 = json.loads((base / MANIFEST).read_text())
    v9 = json.loads((tmp_path / "v9" / MANIFEST).read_text())
    assert v9 != v1 and v9.get("version") == "v9"
    assert not (tmp_path / "v9" / "weightroll-demo-model.json").exists()
    assert (base / MANIFEST).read_text() == before  # an existing checkpoint is left alone
