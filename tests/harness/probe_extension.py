"""Test-only worker extension: weightroll's extension plus read-only probes of the live model.

The probes read what the kernels actually use, which is not always a parameter: on CPU, vLLM
packs linear weights into a GEMM closure (``layer.cpu_linear``) and leaves ``weight`` as an
empty placeholder, so :meth:`probe_dense_weights` recovers each linear's effective weight by
passing an identity matrix through that closure (exact in bf16: one product per output).
"""

from __future__ import annotations

from typing import Any

import torch

from engine_agent.vllm_extension import WeightRollExtension


class ProbeExtension(WeightRollExtension):
    def probe_storage(self, _args: str = "{}") -> dict[str, int]:
        """data_ptr of every parameter, buffer and registered derived tensor."""
        engine = self._weightroll_engine()
        return {name: rec.data_ptr for name, rec in engine.index.storage_snapshot().items()}

    def probe_dense_weights(self, _args: str = "{}") -> dict[str, torch.Tensor]:
        """Effective weight of every indexed module parameter, in checkpoint layout."""
        model: Any = self.model_runner.model  # type: ignore[attr-defined]
        out: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            for pname, param in list(module._parameters.items()):
                if param is None:
                    continue
                if pname == "weight" and param.numel() == 0 and hasattr(module, "cpu_linear"):
                    in_features = int(getattr(module, "input_size_per_partition", 0) or 0)
                    if not in_features:
                        continue
                    eye = torch.eye(in_features, dtype=param.dtype)
                    dense = module.cpu_linear(eye, param, None)
                    out[f"{name}.weight"] = dense.t().contiguous().clone()
                else:
                    out[f"{name}.{pname}"] = param.detach().clone()
        return out
