"""Fixtures of the docs tier: the e2e tier's dev cluster, for pages whose commands a test runs.

Re-exported, not copied: ``injected`` is ``weightroll_dev dev up --pods 2 --inject`` with its
teardown (:mod:`tests.e2e.conftest`), one cluster shared with ``tests/e2e/test_injection.py``
(:mod:`tests.e2e.shared_fleet`); it skips, saying why, where the dev cluster cannot run.
"""

from tests.e2e.conftest import injected

__all__ = ["injected"]
