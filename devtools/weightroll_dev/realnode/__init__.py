"""A real one-node Kubernetes 1.20 inside a network namespace: kubelet, containerd, controllers.

The dev cluster of :mod:`weightroll_dev.devcluster` has no kubelet: a stand-in writes the pods'
Ready condition. This package runs the real components instead, so Ready, readiness gates,
probes, restarts and Endpoints are decided by Kubernetes itself (issue 29):

* :mod:`.config`: the node's directory layout and its containerd, CNI and kubelet configuration;
* :mod:`.images`: the pause and tiny images, built here and imported (no registry is reachable);
* :mod:`.host`: what the node changes on the host (cgroups, mounts, kernel settings, host
  directories) and a snapshot to prove ``down`` took all of it back;
* :mod:`.pods`: hostPath mounts that run the checkout's virtualenv in a tiny-image pod;
* :mod:`.node`: ``up`` (to node Ready) and ``down``;
* :mod:`.cli`: ``python -m weightroll_dev node up|down``;
* :mod:`.workload` and :mod:`.devcluster`: ``weightroll_dev dev up --node real``, the chart's
  example workload (vLLM CPU pods with the agent) and the operator on the node;
* :mod:`.sampler`: a Service's EndpointSlices and the agents behind them, sampled in the
  namespace, the verdict of a rollout on the node.

Limitations: one real node per host; root only; the pods run as root (the interpreter lives
under ``/root``). Facts and walls:
``../shared/design/real-node.md`` and docs/real-node.md.
"""

from weightroll_dev.realnode.node import NodeError, RealNode, down, missing_prerequisites, up

__all__ = ["NodeError", "RealNode", "down", "missing_prerequisites", "up"]
