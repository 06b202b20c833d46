"""Storage and kernel identity (engine-reload.md R5).

At ``begin`` each rank records, for every tensor a kernel can read — parameters, buffers and the
derived tensors registered by :mod:`engine_agent.reload.derived` — its data pointer, storage
offset, shape, stride and dtype, and for every module its kernel identity (quant method, the
CPU GEMM closure's code location, attention implementation, MoE experts class). At ``finish``
both must be unchanged: a moved tensor would leave a captured CUDA graph reading stale memory,
and a changed kernel means the live layout is not the one the update assumed.

The comparison is pure; :func:`storage_record` is the only function touching a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StorageRecord", "compare_kernels", "compare_storage", "kernel_tag", "storage_record"]


@dataclass(frozen=True, slots=True)
class StorageRecord:
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}@{self.data_ptr:#x}+{self.storage_offset}"


def storage_record(tensor: Any) -> StorageRecord:
    """Identity of one tensor's storage (a ``torch.Tensor``; typed ``Any`` to keep this pure)."""
    return StorageRecord(
        data_ptr=int(tensor.data_ptr()),
        storage_offset=int(tensor.storage_offset()),
        shape=tuple(int(s) for s in tensor.shape),
        stride=tuple(int(s) for s in tensor.stride()),
        dtype=str(tensor.dtype).removeprefix("torch."),
    )


def compare_storage(
    before: Mapping[str, StorageRecord], after: Mapping[str, StorageRecord]
) -> list[str]:
    """Describe every tensor that disappeared, appeared or changed storage identity."""
    problems = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if new is None:
            problems.append(f"{name}: tensor disappeared (was {old.describe() if old else '?'})")
        elif old is None:
            problems.append(f"{name}: new tensor appeared ({new.describe()})")
        else:
            problems.append(f"{name}: storage changed {old.describe()} -> {new.describe()}")
    return problems


def kernel_tag(module: Any) -> str:
    """A string naming the kernels a module runs; equal tags mean an unchanged live layout."""
    parts = [type(module).__name__]
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None:
        parts.append(f"qm={type(quant_method).__name__}")
        moe_kernel = getattr(quant_method, "moe_kernel", None)
        fused = getattr(moe_kernel, "fused_experts", None)
        if fused is not None:
            parts.append(f"experts={type(fused).__name__}")
    cpu_linear = module.__dict__.get("cpu_linear")
    if cpu_linear is not None:
        code = getattr(cpu_linear, "__code__", None)
        where = f"{code.co_name}:{code.co_firstlineno}" if code is not None else repr(cpu_linear)
        parts.append(f"cpu_gemm={where}")
    impl = getattr(module, "impl", None)
    if impl is not None:
        parts.append(f"impl={type(impl).__name__}")
    return " ".join(parts)


def compare_kernels(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """Describe every module whose kernel identity changed."""
    return [
        f"{name}: kernel changed {before.get(name)!r} -> {after.get(name)!r}"
        for name in sorted(before.keys() | after.keys())
        if before.get(name) != after.get(name)
    ]
