"""The registry sweep's per-architecture check, in CI, for a fixed representative subset (issue 26).

``make engine-sweep`` (:mod:`weightroll_dev.engine_sweep`) runs every decoder architecture of
vLLM's registry and writes ``docs/models.md``; that takes hours on CPU, so CI runs the same
:func:`~weightroll_dev.engine_sweep.check_architecture` for one architecture per family that
the families already tested do not cover (DeepSeek-V3, GPT-2 and MiniMax-M2 are in
``tests/engine/test_families.py``):

* ``Qwen3ForCausalLM``: q/k norms per head, GQA;
* ``Gemma2ForCausalLM``: the ``1 + weight`` norms (four per layer), logit soft-capping, tied
  embeddings (the LM head reads the embedding), sliding-window layers;
* ``Phi3ForCausalLM``: fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint itself;
* ``MixtralForCausalLM``: a mixture of experts (the CPU fused-MoE kernel's own weight layout);
* ``GptOssForCausalLM``: a loader that writes parameters itself, not through their weight
  loaders (its experts' fused weights and biases with ``param.copy_``, its attention sinks with
  ``param.data.copy_``; ``engine_agent/reload/direct.py``) — every full update of it failed
  coverage after writing, and the replica was poisoned;
* ``ApertusForCausalLM``: checkpoint *buffers* — its XIELU activation keeps ``beta`` and
  ``eps`` as persistent buffers beside its parameters, loaded by name by vLLM's
  ``AutoWeightsLoader`` (``engine_agent/reload/index.py`` ``_checkpoint_buffers``); every full
  and partial update of it was refused as derived state with no refresher;
* ``Gemma4ForCausalLM``: a checkpoint buffer on a module without parameters — the decoder
  layer's ``layer_scalar``; counted only on modules with parameters, it was outside the index,
  the check run's meta tensor reached the live buffer, and every full and partial update was
  refused;
* ``FalconH1ForCausalLM``: a mamba mixer (``MambaMixer2``) whose ``conv_weights`` view of its
  conv1d weight is left holding the old storage once vLLM's CPU conv prepack replaces the
  weight's (``engine_agent/reload/derived.py`` ``CpuConvPrepackRefresher``; GraniteMoeHybrid
  has the same mixer);
* ``Qwen3NextForCausalLM``: the prepacked conv1d's un-packed copy
  (``_cpu_unpacked_conv_weight``) that its gated delta net reads, and attention layers beside
  linear-attention ones. On a CPU without the conv prepack (no AVX512-BF16) both run with the
  plain weight, and the check still holds.

For each, a tiny random checkpoint is built from transformers' config class, and a full update
A -> B, a partial update of decoder layer 1 and a sparse patch of a norm must each equal a cold
engine on the checkpoint they should produce, in outputs and in the bitwise census.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from weightroll_dev.engine_sweep import EQUAL, check_architecture

SUBSET = (
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Phi3ForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "ApertusForCausalLM",
    "Gemma4ForCausalLM",
    "FalconH1ForCausalLM",
    "Qwen3NextForCausalLM",
)


@pytest.mark.parametrize("architecture", SUBSET)
def test_full_partial_and_sparse_updates_equal_a_cold_engine(
    architecture: str, tmp_path: Path
) -> None:
    verdicts = check_architecture(architecture, tmp_path)
    assert (verdicts.full, verdicts.partial, verdicts.sparse) == (EQUAL, EQUAL, EQUAL), verdicts
