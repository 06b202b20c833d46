"""Pure rollout logic: no I/O, no clock, no Kubernetes or HTTP clients (house rules 5 and 15).

``plan.plan`` is the algorithm of record; ``fleet`` turns observed pods and agents into frozen
views; ``conditions`` and ``status`` compute what the operator reports; ``admission`` decides
when a pod no WeightUpdate selects gets its readiness gate.
"""

__all__: list[str] = []
