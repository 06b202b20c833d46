"""The simulated cluster of the simulation tier (``tests/sim``; docs/architecture.md, "The
simulation tier").

Three modules, one concept each: :mod:`.cluster` (a virtual clock and an in-memory API server
that plays kubelet and the operator's pod index), :mod:`.agents` (pods whose agent is the real
``engine_agent.sidecar.agent.Agent`` over simulated vLLM ranks), :mod:`.invariants` (what must
hold after every step). The state machine that drives them is ``tests/sim/test_rollout_sim.py``.
"""
