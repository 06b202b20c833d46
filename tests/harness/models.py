"""Tiny random models for tests: see :mod:`engine_agent.tinymodels` (shared with the demo)."""

from engine_agent import tinymodels
from engine_agent.tinymodels import *  # noqa: F403

__all__ = tinymodels.__all__
