"""The bitwise census oracle: every tensor a rank's kernels can read, found without our bookkeeping.

Logits of two engines can differ by kernel selection; weights cannot. So beside the logits
oracle the engine tier compares, byte for byte, every tensor reachable from the live model
against a cold engine on the same checkpoint. The walk is deliberately independent of
weightroll's own index and inventory (``engine_agent.reload``): it starts at the model and
follows what Python can reach —

* every module's parameters and buffers;
* every tensor held in a module attribute, directly or inside lists, tuples, dicts and plain
  objects (MLA's ``W_UK_T``/``W_UV``, quantization scales, attention-backend state);
* every tensor captured by a kernel closure or ``functools.partial`` stored on a module (the CPU
  GEMM's packed weight copy in ``cpu_linear``), so a kernel's private copy is judged too;
* what each CPU GEMM kernel *computes*: its output on an identity matrix, i.e. the effective
  weight (exact in bf16: one product per output). oneDNN keeps its packed weight behind an
  opaque handle (a 0-dim integer tensor holding an address), which is left out as such: the
  kernel's output judges what the handle points at.

What is not weight-derived is left out by name: the KV cache (runtime state by design). The
census entry of a tensor is its dtype, shape, stride, ``data_ptr`` and a SHA-256 of its bytes;
:func:`differences` compares the content of two censuses and :func:`moved` the storage of two
censuses of one engine (graph-captured addresses must not move across an update).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Entry", "census", "differences", "moved"]

#: Attributes that hold runtime state, not weights: compared by neither side.
RUNTIME_ATTRIBUTES = frozenset({"kv_cache"})
#: How deep the walk follows plain objects and closures below a module attribute.
MAX_DEPTH = 6
#: Objects of these packages are followed; anything else (configs of other libraries, loggers,
#: locks, the tokenizer) cannot hold a kernel's tensor and is skipped to keep the walk bounded.
FOLLOWED_PACKAGES = ("vllm", "torch", "engine_agent", "tests", "functools", "builtins")


@dataclass(frozen=True, slots=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    data_ptr: int
    sha256: str

    def content(self) -> tuple[str, tuple[int, ...], str]:
        """What a cold engine must equal: dtype, shape and bytes (not where they live)."""
        return (self.dtype, self.shape, self.sha256)


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach()
    if data.is_meta:
        return "meta"
    flat = data.contiguous().cpu().reshape(-1)
    if flat.numel() == 0:
        return "empty"
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _entry(tensor: torch.Tensor) -> Entry:
    return Entry(
        dtype=str(tensor.dtype),
        shape=tuple(tensor.shape),
        stride=tuple(tensor.stride()),
        data_ptr=0 if tensor.is_meta else tensor.data_ptr(),
        sha256=_digest(tensor),
    )


def _followed(value: object) -> bool:
    module = type(value).__module__ or ""
    return module.split(".", 1)[0] in FOLLOWED_PACKAGES


def _reachable(value: Any, path: str, depth: int, seen: set[int]) -> Iterator[tuple[str, Any]]:
    """``(path, tensor)`` for every tensor reachable from ``value`` (not through modules)."""
    if id(value) in seen or depth > MAX_DEPTH:
        return
    if isinstance(value, torch.Tensor):
        seen.add(id(value))
        yield path, value
        return
    if isinstance(value, torch.nn.Module) or value is None:
        return  # modules are walked from the model's own tree
    if isinstance(value, (str, bytes, int, float, bool, type)):
        return
    seen.add(id(value))
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _reachable(item, f"{path}[{key!r}]", depth + 1, seen)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            yield from _reachable(item, f"{path}[{index}]", depth + 1, seen)
    elif isinstance(value, functools.partial):
        yield from _reachable(value.func, f"{path}.func", depth + 1, seen)
        yield from _reachable(value.args, f"{path}.args", depth + 1, seen)
        yield from _reachable(value.keywords, f"{path}.keywords", depth + 1, seen)
    elif callable(value) and hasattr(value, "__code__"):
        names = value.__code__.co_freevars
        for name, cell in zip(names, value.__closure__ or (), strict=False):
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from _reachable(content, f"{path}<{name}>", depth + 1, seen)
        bound = getattr(value, "__self__", None)
        if bound is not None:
            yield from _reachable(bound, f"{path}.__self__", depth + 1, seen)
    elif _followed(value) and hasattr(value, "__dict__"):
        for attr, item in vars(value).items():
            yield from _reachable(item, f"{path}.{attr}", depth + 1, seen)


def _handle(path: str, tensor: torch.Tensor) -> bool:
    """A kernel's opaque handle: a 0-dim integer held in a closure (its value is an address)."""
    return "<" in path and tensor.ndim == 0 and not tensor.is_floating_point()


def _through_kernel(module: torch.nn.Module) -> torch.Tensor | None:
    """The effective weight a module's CPU GEMM kernel applies, read through the kernel."""
    kernel = module.__dict__.get("cpu_linear")
    weight = module._parameters.get("weight")
    if not callable(kernel) or weight is None:
        return None
    if weight.ndim == 2 and weight.numel():
        in_features = int(weight.shape[1])
    else:  # the packed path leaves an empty placeholder
        in_features = int(getattr(module, "input_size_per_partition", 0) or 0)
    if not in_features:
        return None
    eye = torch.eye(in_features, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        applied: torch.Tensor = kernel(eye, weight, None)
    return applied.t().contiguous()


def census(model: torch.nn.Module) -> dict[str, Entry]:
    """Every tensor the kernels of ``model`` can read, by the first path that reaches it.

    A tensor reachable by several paths (a tied weight, a view kept in an attribute) is listed
    once, under the first path in module order; the same model walked twice lists the same
    paths, so two engines built from the same code compare path by path.
    """
    seen: set[int] = set()
    found: dict[str, Entry] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for kind in ("_parameters", "_buffers"):
            for name, tensor in module.__dict__[kind].items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    found[f"{dot}{name}"] = _entry(tensor)
        for attr, value in vars(module).items():
            if attr in ("_parameters", "_buffers", "_modules") or attr in RUNTIME_ATTRIBUTES:
                continue
            if isinstance(value, torch.nn.Module):
                continue
            for path, tensor in _reachable(value, f"{dot}{attr}", 0, seen):
                if not _handle(path, tensor):
                    found[path] = _entry(tensor)
        effective = _through_kernel(module)
        if effective is not None:
            found[f"{dot}cpu_linear<applied to the identity>"] = _entry(effective)
    return found


def differences(live: Mapping[str, Entry], cold: Mapping[str, Entry]) -> list[str]:
    """Where ``live`` differs in content from ``cold``: one line per tensor, sorted."""
    lines = [f"only in the live engine: {name}" for name in sorted(live.keys() - cold.keys())]
    lines += [f"only in the cold engine: {name}" for name in sorted(cold.keys() - live.keys())]
    for name in sorted(live.keys() & cold.keys()):
        mine, theirs = live[name], cold[name]
        if mine.content() != theirs.content():
            lines.append(
                f"{name}: live {mine.content()[:2]} differs from cold {theirs.content()[:2]}"
            )
    return lines


def moved(before: Mapping[str, Entry], after: Mapping[str, Entry]) -> list[str]:
    """Tensors of one engine whose storage moved or whose layout changed between two censuses.

    A tensor held only by a kernel closure (a path with ``<captured>``) may move: the module's
    kernel attribute is read on every call, so a rebuilt kernel is a new closure with its own
    copy. Everything a captured graph can hold an address of — parameters, buffers, module
    tensor attributes — must stay where it was.
    """
    lines = [f"vanished: {name}" for name in sorted(before.keys() - after.keys())]
    lines += [f"appeared: {name}" for name in sorted(after.keys() - before.keys())]
    for name in sorted(before.keys() & after.keys()):
        if "<" in name:
            continue
        old, new = before[name], after[name]
        if (old.data_ptr, old.shape, old.stride, old.dtype) != (
            new.data_ptr,
            new.shape,
            new.stride,
            new.dtype,
        ):
            lines.append(f"{name}: storage or layout changed")
    return lines
