"""The sweep's choice of what a partial update replaces and what a sparse patch writes."""

from __future__ import annotations

import pytest
from weightroll_dev.engine_sweep import layer_prefix, norm_weight


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
