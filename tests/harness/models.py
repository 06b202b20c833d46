"""Tiny random models for tests: see :mod:`engine_agent.tinymodels` (shared with the demo)."""

from engine_agent.tinymodels import (
    KINDS,
    build_tiny_model,
    load_tensors,
    random_checkpoint,
    tiny_tokenizer,
    write_subset,
    write_tensors,
)

__all__ = [
    "KINDS",
    "build_tiny_model",
    "load_tensors",
    "random_checkpoint",
    "tiny_tokenizer",
    "write_subset",
    "write_tensors",
]
