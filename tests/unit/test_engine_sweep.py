"""The sweep's tiny configs, its choice of what a partial update replaces and what a sparse
patch writes, and the reasons it gives for a row that does not run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest
from weightroll_dev.engine_sweep import _describe, _inspection_cause, layer_prefix, norm_weight
from weightroll_dev.sweep_models import SHRINK, tiny_config


@pytest.mark.parametrize(
    ("names", "prefix"),
    [
        (["model.layers.0.a.weight", "model.layers.1.a.weight"], "model.layers.1."),
        (["transformer.h.0.ln.weight", "transformer.h.1.ln.weight"], "transformer.h.1."),
        # LongCat-Flash: one decoder layer of two sublayers; the only layer is the scope.
        (["model.layers.0.self_attn.0.q.weight", "model.norm.weight"], "model.layers.0."),
        # HRM-Text: the layers of a nested module.
        (["model.H_module.layers.1.o.weight"], "model.H_module.layers.1."),
    ],
)
def test_the_partial_scope_is_the_second_layer_or_the_only_one(
    names: list[str], prefix: str
) -> None:
    assert layer_prefix(names) == prefix


def test_a_checkpoint_without_layers_has_no_partial_scope() -> None:
    with pytest.raises(LookupError, match="no decoder layer"):
        layer_prefix(["embed.weight", "lm_head.weight"])


@pytest.mark.parametrize(
    ("shapes", "chosen"),
    [
        # A norm in the scope first, then any norm, then any 1-D tensor that holds entry 7.
        (
            {"m.norm.weight": (128,), "m.layers.1.input_layernorm.weight": (128,)},
            "m.layers.1.input_layernorm.weight",
        ),
        ({"m.norm.weight": (128,), "m.layers.1.o.weight": (128, 128)}, "m.norm.weight"),
        ({"m.z_L_init": (128,), "m.bias_short": (4,), "m.o.weight": (8, 8)}, "m.z_L_init"),
    ],
)
def test_the_sparse_target_is_a_norm_or_else_a_vector(
    shapes: dict[str, tuple[int, ...]], chosen: str
) -> None:
    assert norm_weight(list(shapes), shapes, "m.layers.1.") == chosen


def test_a_checkpoint_of_matrices_only_has_no_sparse_target() -> None:
    shapes = {"m.o.weight": (8, 8), "m.short": (4,)}
    with pytest.raises(LookupError, match="no 1-D tensor"):
        norm_weight(list(shapes), shapes, "m.layers.1.")


# ------------------------------------------------------------------ tiny configs


@pytest.mark.parametrize(
    ("model_type", "field", "value"),
    [
        # Fields vLLM's model reads that only the release config.json writes.
        ("afmoe", "score_func", "sigmoid"),
        ("glm4_moe_lite", "first_k_dense_replace", 1),
        ("hy_v3", "first_k_dense_replace", 1),
        ("lfm2", "block_dim", SHRINK["hidden_size"]),
        ("hy_v3", "expert_hidden_dim", SHRINK["moe_intermediate_size"]),
        ("hy_v3", "qk_norm", True),
        ("longcat_flash", "mla_scale_q_lora", True),
        ("longcat_flash", "zero_expert_type", "identity"),
        ("mimo_v2_flash", "hybrid_layer_pattern", [0, 1]),
        ("mimo_v2_flash", "layernorm_epsilon", 1e-5),
        # vLLM's MoE applies the router weight on the input (Llama 4) only for top-1.
        ("llama4_text", "num_experts_per_tok", 1),
        # A.X-K1's grouped routing at 4 experts: one group.
        ("axk1", "n_group", 1),
    ],
)
def test_the_tiny_config_has_the_release_fields_vllm_reads(
    model_type: str, field: str, value: Any
) -> None:
    assert getattr(tiny_config(model_type), field) == value


def test_the_first_dense_layers_agree_with_transformers_layer_types() -> None:
    # vLLM splits dense from MoE layers by first_k_dense_replace, transformers by
    # mlp_layer_types: the checkpoint has the experts vLLM builds only if both agree.
    for model_type in ("glm4_moe_lite", "hy_v3"):
        config = tiny_config(model_type)
        dense = [t for t in config.mlp_layer_types if t == "dense"]
        assert len(dense) == config.first_k_dense_replace
        assert config.mlp_layer_types[: len(dense)] == dense


def test_dbrx_attention_has_its_rope_theta_and_tiny_experts() -> None:
    config = tiny_config("dbrx")
    assert config.attn_config.rope_theta == 500_000
    assert config.ffn_config.ffn_hidden_size == SHRINK["intermediate_size"]
    assert config.ffn_config.hidden_size == SHRINK["hidden_size"]


def test_gemma4_has_a_per_layer_head_dim_and_no_experts() -> None:
    config = tiny_config("gemma4_text")
    # head_dim is per layer (the full-attention layers use global_head_dim): its global read
    # raises, and the shrink still sets the sliding layers' one.
    assert config.to_dict()["head_dim"] == SHRINK["head_dim"]
    assert config.layer_types[-1] == "full_attention"
    # vLLM builds Gemma 4's MoE block whenever num_experts is set.
    assert config.num_experts is None
    assert config.vocab_size_per_layer_input == SHRINK["vocab_size"]


def test_gemma3n_shares_kv_of_an_earlier_layer_of_each_type() -> None:
    config = tiny_config("gemma3n_text")
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    assert 0 < first_shared < config.num_hidden_layers
    for kind in config.layer_types[first_shared:]:
        assert kind in config.layer_types[:first_shared]
    assert config.vocab_size_per_layer_input == SHRINK["vocab_size"]


def test_mimo_v2_flash_layer_plan_matches_transformers_layers() -> None:
    config = tiny_config("mimo_v2_flash")
    swa = [int(t == "sliding_attention") for t in config.layer_types]
    moe = [int(t == "sparse") for t in config.mlp_layer_types]
    assert config.hybrid_layer_pattern == swa and config.moe_layer_freq == moe
    # transformers doubles the KV heads of its SWA layers
    assert config.swa_num_key_value_heads == 2 * config.num_key_value_heads


def test_zamba2_attention_head_is_twice_the_hidden_width_over_heads() -> None:
    config = tiny_config("zamba2")
    assert config.attention_head_dim * config.num_attention_heads == config.attention_hidden_size
    assert config.num_key_value_heads == config.num_attention_heads  # vLLM's has no GQA
    assert len(config.layers_block_type) == config.num_hidden_layers


@pytest.mark.parametrize(
    "model_type",
    ["dbrx", "gemma3n_text", "gemma4_text", "lfm2_moe", "zamba2", "longcat_flash", "axk1"],
)
def test_transformers_builds_the_tiny_model(model_type: str) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))
    # Tiny: a full-size table left unshrunk (a per-layer embedding of 262,144 rows) is not.
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


# ------------------------------------------------------------------ a row's reason


class _EngineConfig(pydantic.BaseModel):
    block_size: int

    @pydantic.field_validator("block_size")
    @classmethod
    def _with_prefix_caching(cls, value: int) -> int:
        raise ValueError("--mamba-block-size can only be set with --enable-prefix-caching")


def test_a_validation_error_reads_as_its_cause_not_its_help_link() -> None:
    with pytest.raises(pydantic.ValidationError) as caught:
        _EngineConfig(block_size=16)
    described = _describe(caught.value)
    assert described == (
        "ValidationError: Value error, --mamba-block-size can only be set with "
        "--enable-prefix-caching"
    )


def _route(scoring_func: str) -> None:
    # What a bare ``assert`` raises outside pytest (which rewrites asserts to carry a message).
    if scoring_func != "softmax":
        raise AssertionError


def test_a_bare_assertion_reads_as_the_statement_that_failed() -> None:
    with pytest.raises(AssertionError) as caught:
        _route("sigmoid")
    line = _route.__code__.co_firstlineno + 3
    assert (
        _describe(caught.value)
        == f"AssertionError: raise AssertionError (test_engine_sweep.py:{line})"
    )


def test_a_model_class_vllm_cannot_import_names_the_import_error(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text(
        "(MainProcess pid=1) ERROR 12-07 10:21:34 [registry.py:1120] Traceback (most recent "
        "call last):\n"
        "(MainProcess pid=1) ERROR 12-07 10:21:34 [registry.py:1120] RuntimeError: Error "
        "raised in subprocess:\n"
        "(MainProcess pid=1) ERROR 12-07 10:21:34 [registry.py:1120] ModuleNotFoundError: No "
        "module named 'torchvision'\n"
        "ValueError: unrelated later line\n"
    )
    assert _inspection_cause(log) == "ModuleNotFoundError: No module named 'torchvision'"
