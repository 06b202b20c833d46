"""Development tooling of a weightroll checkout: the dev cluster, the demos and the tiny models.

Nothing here ships: the wheel and the images contain ``engine_agent`` and ``weightroll_operator``
only (``tests/unit/test_packaging.py`` builds the wheel and checks it), and no product module
imports this package (an import-linter contract). ``python -m weightroll_dev demo|dev``
(:mod:`.__main__`) runs its commands from a checkout, with ``devtools/`` on ``PYTHONPATH``
(``make demo`` sets it).

Modules:
    * :mod:`.devcluster`: a local kube-apiserver, a kubelet stand-in running pods as processes,
      the operator as a process, and ``weightroll_dev dev up|down``;
    * :mod:`.demo_cluster`, :mod:`.demo_view`: ``weightroll_dev demo`` (``make demo``);
    * :mod:`.demo_engine`: ``weightroll_dev demo --engine`` (one vLLM engine, no cluster);
    * :mod:`.tinymodels`: tiny Hugging Face checkpoints built locally (tests, benches, demos).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CHECKOUT", "checkout_pythonpath"]

#: The checkout this package lives in (``devtools/weightroll_dev/__init__.py`` -> the root).
CHECKOUT = Path(__file__).resolve().parents[2]


def checkout_pythonpath() -> str:
    """``PYTHONPATH`` for child processes that must import this checkout's code, not another
    install's: the root (``engine_agent``, ``tests``), ``operator/`` and ``devtools/``."""
    return os.pathsep.join(str(CHECKOUT / p) for p in ("", "operator", "devtools"))
