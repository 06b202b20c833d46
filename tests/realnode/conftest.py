"""One ``dev up --node real`` cluster for every real-node test module of a session.

A bring-up costs about 100 s (the node, the chart, vLLM pods booting on shared cores), so the
rollout and the scenario modules share it; the node's own test (``test_real_node.py``) brings
up and takes down a bare node of its own before it, as pytest runs the modules in name order,
so only one real node is ever alive. The cluster is taken down at the end of the session and
``dev down`` must report nothing left behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from weightroll_dev.realnode import devcluster

from tests.harness.realnode_fleet import RealFleet

PODS = 2


@pytest.fixture(scope="session")
def real_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealFleet]:
    directory = tmp_path_factory.mktemp("real-dev")
    began = time.monotonic()
    try:
        info = devcluster.up(directory, PODS, say=lambda line: print(line, flush=True))
        print(f"dev up --node real: {time.monotonic() - began:.1f} s", flush=True)
        fleet = RealFleet(directory.resolve(), info)
        fleet.ensure_service()
        yield fleet
    finally:
        began = time.monotonic()
        problems = devcluster.down(directory)
        print(f"dev down: {time.monotonic() - began:.1f} s", flush=True)
        assert not problems, problems
