"""What a benchmark figure was measured on: printed beside every figure (figures differ by CPU).

The same verified update measured 1.0x vLLM's reload on an AVX-512 EPYC and 1.35x on an AVX2
one, so every report names the CPU model *and* the vector extensions the kernels can use.
"""

from __future__ import annotations

import os
from pathlib import Path

#: The /proc/cpuinfo flags that decide which CPU kernels torch and vLLM pick (in this order).
VECTOR_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
)


def _cpuinfo_field(name: str) -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), e.g. ``AMD EPYC``; ``unknown`` elsewhere."""
    return _cpuinfo_field("model name") or "unknown"


def cpu_flags() -> list[str]:
    """Which of :data:`VECTOR_FLAGS` this CPU has (x86 ``flags`` or Arm ``Features``)."""
    present = set((_cpuinfo_field("flags") or _cpuinfo_field("Features") or "").split())
    return [flag for flag in VECTOR_FLAGS if flag in present]


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages when the run ended (other jobs slow a run)."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict[str, object]:
    """The ``machine`` object every benchmark prints: CPU model, vector flags, cores, load."""
    return {
        "cpu": cpu_model(),
        "cpuFlags": cpu_flags(),
        "cores": os.cpu_count(),
        "loadAverage": load_average(),
    }
