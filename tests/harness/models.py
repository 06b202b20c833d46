"""Tiny random models for tests: see :mod:`weightroll_dev.tinymodels` (in devtools/; shared)."""

from weightroll_dev import tinymodels
from weightroll_dev.tinymodels import *  # noqa: F403

__all__ = tinymodels.__all__
