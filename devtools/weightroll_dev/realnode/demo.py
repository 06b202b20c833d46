"""``make demo NODE=real``: the demo's cluster on the real node instead of the stand-in.

:class:`DemoNode` brings ``dev up --node real`` up (:func:`.devcluster.up`, on the host) and
then moves the demo's own thread into the node's network namespace, where the apiserver and
the pods' addresses are (every client of the node runs inside it): the demo's API reads, its
prompts to vLLM and its agent reads then go there unchanged, and so do the kubectl processes
it starts (a child is born in its parent thread's namespace). :meth:`DemoNode.down` moves the
thread back first, then takes the cluster down.

The rest of the demo is the stand-in's (:mod:`weightroll_dev.demo_cluster`):
:func:`cluster_info` gives it the same :class:`~weightroll_dev.devcluster.bringup.ClusterInfo`
it reads there, with the pods' bridge addresses instead of loopback ones.

Limitations: Linux and root (``setns``); only the calling thread moves, so a thread started
before :meth:`DemoNode.up` stays on the host. No per-pod checkpoint copies exist on the real
node (one hostPath volume), so the ``fail`` scenario, which corrupts one pod's copy, is refused.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from weightroll_dev.devcluster.bringup import ClusterInfo, DevError
from weightroll_dev.realnode import devcluster, missing_prerequisites
from weightroll_dev.realnode.node import NodeError

__all__ = ["DemoNode", "cluster_info"]

#: ``CLONE_NEWNET`` of <sched.h>: setns(2) joins a network namespace.
_CLONE_NEWNET = 0x40000000


def _join(fd: int) -> None:
    """Move the calling thread into the network namespace ``fd`` refers to."""
    if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def cluster_info(directory: Path, info: dict[str, Any]) -> ClusterInfo:
    """The stand-in's view of a real-node ``cluster.json`` (``info``) in ``directory``."""
    pods: dict[str, str] = info["pods"]
    return ClusterInfo(
        kubeconfig=info["kubeconfig"],
        namespace=info["namespace"],
        selector=dict(info["selector"]),
        tokenSecret=info["tokenSecret"],
        checkpoints=info["checkpoints"],
        pods={name: f"http://{ip}:8000/v1" for name, ip in pods.items()},
        agents={name: f"http://{ip}:8470" for name, ip in pods.items()},
        agentToken=info["agentToken"],
        servedModel=info["servedModel"],
        references={},
        podVolumes={},  # one hostPath for every pod: no copy of its own
        persistentVolume=str(directory / "pv-models"),
        operatorMetricsUrl=info["operatorMetricsUrl"],
        operatorLog=info["operatorLog"],
        operatorPid=info["operatorPid"],
        supervisorPid=0,  # nothing publishes checkpoints on the real node
        dir=str(directory),
    )


class DemoNode:
    """The real-node cluster of one demo run, and the demo thread's namespace."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        #: The host's network namespace while the thread is inside the node's (to go back).
        self._host_fd: int | None = None
        #: The node's network namespace (under /run/netns), once up.
        self.netns = ""

    def up(self, pods: int, say: Callable[[str], None]) -> ClusterInfo:
        """Bring the cluster up and enter its namespace.

        Raises:
            DevError: a prerequisite is missing, or the bring-up failed (already taken down).
        """
        missing = missing_prerequisites()
        if missing:
            raise DevError("the real node needs: " + "; ".join(missing))
        try:
            info = devcluster.up(self.directory, pods, say=say)
        except NodeError as e:
            raise DevError(str(e)) from None
        self.netns = info["netns"]
        node = os.open(f"/run/netns/{self.netns}", os.O_RDONLY)
        try:
            self._host_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
            _join(node)
        finally:
            os.close(node)
        return cluster_info(self.directory.resolve(), info)

    def down(self, say: Callable[[str], None]) -> None:
        """Back to the host's namespace, then ``dev down``; says what stayed behind."""
        if self._host_fd is not None:
            _join(self._host_fd)
            os.close(self._host_fd)
            self._host_fd = None
        for problem in devcluster.down(self.directory):
            say(f"left behind: {problem}")
