"""Fixtures of the chart tests: the real kube-apiserver (tests/harness/apiserver.py)."""

from __future__ import annotations

from tests.harness.apiserver import kube_cluster

__all__ = ["kube_cluster"]
