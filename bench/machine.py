"""What a benchmark figure was measured on: printed beside every figure (figures differ by CPU)."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), e.g. ``AMD EPYC``; ``unknown`` elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages when the run ended (other jobs slow a run)."""
    return [round(x, 2) for x in os.getloadavg()]
