"""A development cluster on one machine: a kubelet stand-in that runs pods as local processes.

The test kube-apiserver (``scripts/kube-apiserver.sh``) has no scheduler and no kubelet, so pods
stay ``Pending`` forever. :class:`PodSimulator` plays kubelet for one namespace: each pod gets a
loopback IP ``127.0.0.N``, its containers run as local processes (the real vLLM OpenAI server
with the weightroll worker extension, the real ``weightroll-agent``), and its status is written
the way kubelet writes it, readiness gates included. The e2e tests and the cluster demo use it.

Modules: :mod:`.podspec` (pure: pod spec -> command lines, kubelet's status),
:mod:`.processes` (process groups), :mod:`.kubelet` (the watch/probe/status loop),
:mod:`.apiserver` (start/stop the local kube-apiserver of ``scripts/kube-apiserver.sh``).

This package imports neither torch nor vLLM nor the agent: it only starts them as subprocesses.
"""

from weightroll_dev.devcluster.kubelet import PodSimulator, SimulatorConfig, SimulatorThread
from weightroll_dev.devcluster.podspec import PodSpecError
from weightroll_dev.devcluster.processes import ContainerProcess

__all__ = [
    "ContainerProcess",
    "PodSimulator",
    "PodSpecError",
    "SimulatorConfig",
    "SimulatorThread",
]
