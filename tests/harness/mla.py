"""MLA's absorbed weights as each vLLM CPU attention backend keeps them.

vLLM picks the MLA backend by CPU (``CpuPlatform.get_attn_backend_cls``): with AMX tiles it is
``AMX_MLA``, which packs its own VNNI copies of ``W_UK``/``W_UV`` into the impl
(``impl._w_uk_packed``/``impl._w_uv_packed``) and *releases* ``kv_b_proj.weight`` (an empty
placeholder); elsewhere it is ``CPU_MLA``, and the layer keeps ``W_UK_T``/``W_UV`` as parameters.
CI machines are of either kind, so a test names the derived tensors of the backend the engine
runs, found in the engine's own storage listing, never the ones of the machine it was written on.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["ABSORBED", "LAYER0", "absorbed_weights", "releases_kv_b_proj"]

#: The MLA attention layer of the tiny DeepSeek-V2's first decoder layer.
LAYER0 = "model.layers.0.self_attn.mla_attn.mla_attn"

#: Backend -> (the tensor derived from W_UK, the one derived from W_UV), under the MLA layer.
ABSORBED = {
    "CPU_MLA": ("W_UK_T", "W_UV"),
    "AMX_MLA": ("impl._w_uk_packed", "impl._w_uv_packed"),
}


def absorbed_weights(names: Collection[str], layer: str = LAYER0) -> tuple[str, str, str]:
    """``(backend, W_UK-derived name, W_UV-derived name)`` of the backend whose pair is in
    ``names`` (an engine's storage listing); fails unless exactly one backend's pair is there."""
    found = [
        (backend, f"{layer}.{uk}", f"{layer}.{uv}")
        for backend, (uk, uv) in ABSORBED.items()
        if f"{layer}.{uk}" in names and f"{layer}.{uv}" in names
    ]
    assert len(found) == 1, (
        f"expected one MLA backend's absorbed weights under {layer}, found {found}: "
        f"{sorted(n for n in names if n.startswith(layer))}"
    )
    return found[0]


def releases_kv_b_proj(backend: str) -> bool:
    """Whether the backend drops ``kv_b_proj.weight`` after packing its own copies: then no live
    tensor is in checkpoint layout, and a sparse patch of it must be refused."""
    return backend == "AMX_MLA"
