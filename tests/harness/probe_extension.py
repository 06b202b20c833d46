"""Test-only worker extension: weightroll's extension plus read-only probes of the live model.

The probes read what the kernels actually use, which is not always a parameter: on CPU, vLLM
packs linear weights into a GEMM closure (``layer.cpu_linear``) and leaves ``weight`` as an
empty placeholder, so :meth:`probe_dense_weights` recovers each linear's effective weight by
passing an identity matrix through that closure (exact in bf16: one product per output).

**Packed GEMM kernels on any CPU.** With AMX or AVX-512 vLLM's CPU GEMM keeps its own packed
copy of each weight inside ``cpu_linear`` (sgl-kernel / oneDNN; vllm-on-cpu.md §9) — for linears
and for the LM head, whose weight a tied model shares with the embedding. On CPUs without them
(this project's CI machines) vLLM falls back to a closure that reads the live weight, and that
whole class of staleness cannot show. With ``WEIGHTROLL_TEST_PACKED_GEMM=1`` in the environment
when a kernel is built, :func:`install_packed_gemm` makes the dispatch behave like the packed
path: the closure captures a private copy of the weight taken at post-load time, and linears'
``weight`` becomes the empty placeholder (``remove_weight``). Numerics are the fallback's
(``F.linear`` on the same bytes), so a cold engine built the same way is the oracle.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engine_agent.vllm_extension import WeightRollExtension
from tests.harness.census import Entry, census

PACKED_GEMM_ENV = "WEIGHTROLL_TEST_PACKED_GEMM"
MLA_COPIES_ENV = "WEIGHTROLL_TEST_MLA_COPIES"


def install_packed_gemm() -> None:
    """Wrap vLLM's CPU GEMM dispatch (idempotent); active while :data:`PACKED_GEMM_ENV` is 1."""
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "weightroll_packed", False):
        return

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = layer.weight
        if os.environ.get(PACKED_GEMM_ENV) != "1" or weight.is_meta or weight.ndim != 2:
            original(layer, remove_weight)
            return
        packed = weight.detach().clone()  # the kernel's own copy, as sgl-kernel/oneDNN keep

        def packed_linear(x: torch.Tensor, _weight: Any, bias: Any) -> torch.Tensor:
            return torch.nn.functional.linear(x, packed, bias)

        layer.cpu_linear = packed_linear
        if remove_weight:
            layer.weight = torch.nn.Parameter(
                torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False
            )

    dispatch.weightroll_packed = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch


install_packed_gemm()


def install_mla_private_copies() -> None:
    """Make MLA's ``W_UK_T``/``W_UV`` tensors of their own (idempotent), while
    :data:`MLA_COPIES_ENV` is 1 when the layer processes its weights.

    An unquantized bf16 ``kv_b_proj`` yields them as *views* of its weight, so refreshing the
    weight refreshes them by aliasing whatever the refresher does. A quantized ``kv_b_proj``
    (FP8 DeepSeek-V3/R1) or an activation dtype other than the weight's makes them separate
    tensors (``get_and_maybe_dequant_weights`` returns a new one); this makes the tiny bf16
    model behave that way. A cold engine built the same way is the oracle.
    """
    from vllm.model_executor.layers.attention import mla_attention

    original = mla_attention.split_kv_b_proj
    if getattr(original, "weightroll_copies", False):
        return

    def split(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        w_uk, w_uv = original(*args, **kwargs)
        if os.environ.get(MLA_COPIES_ENV) != "1":
            return w_uk, w_uv
        return w_uk.clone(), w_uv.clone()

    split.weightroll_copies = True  # type: ignore[attr-defined]
    mla_attention.split_kv_b_proj = split


install_mla_private_copies()


def _own_state(kernel: Any) -> bool:
    """Whether a GEMM closure holds state of its own (the fallback reads the live weight)."""
    return kernel is not None and bool(getattr(kernel, "__closure__", None))


class ProbeExtension(WeightRollExtension):
    def probe_stray_write(self, args: str = "{}") -> str:
        """Add 1 to the first element of the named parameter in place (a stray write)."""
        import json

        name = json.loads(args)["name"]
        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        param = dict(model.named_parameters())[name]
        with torch.no_grad():
            param.view(-1)[0] += 1
        return name

    def probe_guard_cost(self, _args: str = "{}") -> dict[str, Any]:
        """Time one still-true content check over every weight (the guard's cost per period)."""
        import time

        from engine_agent.reload.guard import DEFAULT_PERIOD_S, StillTrueGuard

        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        tensors = {n: t for n, t in model.named_parameters() if t.numel()}
        tensors |= {n: t for n, t in model.named_buffers() if t.numel()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

        guard = StillTrueGuard(
            tensors=lambda: tensors,
            kernels=self._weightroll_engine().index.kernel_snapshot,
            period=0,
        )
        guard.seal()
        started = time.perf_counter()
        assert guard.violations() == []
        check_s = time.perf_counter() - started
        return {
            "weight_bytes": nbytes,
            "guard_check_s": round(check_s, 4),
            "guard_share_at_default_period": round(check_s / DEFAULT_PERIOD_S, 6),
        }

    def probe_census(self, _args: str = "{}") -> dict[str, Entry]:
        """Every tensor the kernels can read (:mod:`tests.harness.census`; not our index)."""
        return census(self.model_runner.model)  # type: ignore[attr-defined]

    def probe_storage(self, _args: str = "{}") -> dict[str, int]:
        """data_ptr of every parameter, buffer and registered derived tensor."""
        engine = self._weightroll_engine()
        return {name: rec.data_ptr for name, rec in engine.index.storage_snapshot().items()}

    def probe_dense_weights(self, _args: str = "{}") -> dict[str, torch.Tensor]:
        """Effective weight of every module parameter, in checkpoint layout.

        A linear's weight is read back through its GEMM kernel; so is every other kernel
        that keeps its own copy of a live weight (``<module>.kernel``: on packed CPU kernels,
        the LM head and the embedding), and every tensor attribute
        (``<module>.<attr>``: MLA ``W_UK_T``/``W_UV``).
        """
        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        out: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            kernel = module.__dict__.get("cpu_linear")
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                if pname == "weight" and param.numel() == 0 and kernel is not None:
                    in_features = int(getattr(module, "input_size_per_partition", 0) or 0)
                    if not in_features:
                        continue
                    eye = torch.eye(in_features, dtype=param.dtype)
                    out[f"{name}.weight"] = kernel(eye, param, None).t().contiguous().clone()
                else:
                    out[f"{name}.{pname}"] = param.detach().clone()
                if pname == "weight" and param.numel() and param.ndim == 2 and _own_state(kernel):
                    eye = torch.eye(param.shape[1], dtype=param.dtype)
                    out[f"{name}.kernel"] = kernel(eye, param, None).t().contiguous().clone()
            for attr, value in vars(module).items():
                if isinstance(value, torch.Tensor) and attr != "kv_cache":
                    out[f"{name}.{attr}"] = value.detach().clone()
        return out

    def probe_inventory(self, _args: str = "{}") -> dict[str, dict[str, Any]]:
        """The inventory a ``begin`` would build now: name -> kind, sources, refresher."""
        engine = self._weightroll_engine()
        return {
            name: {"kind": i.kind, "sources": sorted(i.sources), "refresher": i.refresher}
            for name, i in engine.index.inventory().items.items()
        }
