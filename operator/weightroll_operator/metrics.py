"""Prometheus metrics of the operator (names from docs/contracts.md, ``weightroll_`` prefix).

Every metric has the labels ``namespace`` and ``name`` (the WeightUpdate) plus the ones listed in
the contract, except ``weightroll_pods_admitted_total``: admission concerns pods no WeightUpdate
selects, so it has ``namespace`` only. :class:`Metrics` owns its registry so tests and the
benchmark can make their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from weightroll_operator.api.v1alpha1 import Phase, ReplicaCounts

__all__ = ["Metrics"]

_DURATION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)
_UNIT_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """The operator's metrics on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._drained: dict[tuple[str, str], set[str]] = {}
        self._unreachable: dict[tuple[str, str], set[str]] = {}
        self._token_reasons: dict[tuple[str, str], set[str]] = {}
        r, wu = self.registry, ["namespace", "name"]
        self.updates_total = Counter(
            "weightroll_updates", "Finished rollouts by outcome", [*wu, "outcome"], registry=r
        )
        self.update_phase = Gauge(
            "weightroll_update_phase", "1 for the current phase", [*wu, "phase"], registry=r
        )
        self.replicas = Gauge(
            "weightroll_replicas", "Selected pods by state", [*wu, "state"], registry=r
        )
        self.progress_deadline = Gauge(
            "weightroll_update_progress_deadline_seconds",
            "spec.strategy.progressDeadlineSeconds",
            wu,
            registry=r,
        )
        self.last_progress = Gauge(
            "weightroll_update_last_progress_timestamp_seconds",
            "Unix time of the last unit transition",
            wu,
            registry=r,
        )
        self.rollout_duration = Histogram(
            "weightroll_rollout_duration_seconds",
            "Start to end of a rollout",
            wu,
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.unit_duration = Histogram(
            "weightroll_unit_update_duration_seconds",
            "Drain to verdict of one unit",
            [*wu, "outcome"],
            buckets=_UNIT_BUCKETS,
            registry=r,
        )
        self.verification_failures = Counter(
            "weightroll_verification_failures",
            "Units that did not commit, by reason",
            [*wu, "reason"],
            registry=r,
        )
        self.last_success = Gauge(
            "weightroll_last_success_timestamp_seconds",
            "Unix time of the last Succeeded rollout",
            wu,
            registry=r,
        )
        self.drained_since = Gauge(
            "weightroll_replica_drained_since_timestamp_seconds",
            "Set while the operator holds a pod drained",
            [*wu, "pod"],
            registry=r,
        )
        self.agent_unreachable = Gauge(
            "weightroll_agent_unreachable",
            "1 while the pod's agent cannot be reached",
            [*wu, "pod"],
            registry=r,
        )
        self.agent_token_unavailable = Gauge(
            "weightroll_agent_token_unavailable",
            "1 while the agent token Secret of the WeightUpdate cannot be read, by reason",
            [*wu, "reason"],
            registry=r,
        )

        self.pod_state = Gauge(
            "weightroll_pod_state",
            "1 for each selected pod's unit state and the version of its weight-state annotation",
            [*wu, "pod", "state", "version"],
            registry=r,
        )
        self._pod_states: dict[tuple[str, str], dict[str, tuple[str, str]]] = {}

        self.pods_admitted = Counter(
            "weightroll_pods_admitted",
            "Pods no WeightUpdate selects whose gate was set True on their boot weights",
            ["namespace"],
            registry=r,
        )

    def forget(
        self, namespace: str, name: str, keep_drained: Mapping[str, float] | None = None
    ) -> int:
        """Remove every series of one WeightUpdate (it was deleted); return how many.

        A deleted WeightUpdate's last phase gauge would otherwise stay exported until the
        operator restarts, and alerts such as a Failed phase would keep firing for an object
        that no longer exists. Pods it left drained (``keep_drained``: pod -> drained since)
        keep their ``drained_since`` series, so ``WeightrollReplicaLeftDrained`` keeps firing while
        the capacity is lost; :meth:`restored` removes them once the pod serves again.
        """
        keep = dict(keep_drained or {})
        removed = 0
        for metric in self._per_weightupdate():
            names = metric._labelnames  # no public accessor
            keys = {
                tuple(sample.labels[n] for n in names)
                for family in metric.collect()
                for sample in family.samples
                if sample.labels.get("namespace") == namespace and sample.labels.get("name") == name
            }
            for key in keys:
                if metric is self.drained_since and key[-1] in keep:
                    continue
                with contextlib.suppress(KeyError):
                    metric.remove(*key)
                    removed += 1
        for pod, since in keep.items():
            self.drained_since.labels(namespace, name, pod).set(since)
        self._drained.pop((namespace, name), None)
        if keep:
            self._drained[(namespace, name)] = set(keep)
        self._unreachable.pop((namespace, name), None)
        self._pod_states.pop((namespace, name), None)
        self._token_reasons.pop((namespace, name), None)
        return removed

    def left_drained(self, namespace: str, name: str, pods: Mapping[str, float]) -> None:
        """Export the drained series of ``pods`` left drained by the deleted ``name`` (rebuilt
        from the pods' own records after an operator restart; see :meth:`forget`)."""
        for pod, since in pods.items():
            self.drained_since.labels(namespace, name, pod).set(since)
        self._drained.setdefault((namespace, name), set()).update(pods)

    def restored(self, namespace: str, name: str, pods: Iterable[str]) -> None:
        """Remove the drained series of ``pods`` left drained by the deleted ``name``."""
        seen = self._drained.get((namespace, name), set())
        for pod in pods:
            with contextlib.suppress(KeyError):
                self.drained_since.remove(namespace, name, pod)
            seen.discard(pod)
        if not seen:
            self._drained.pop((namespace, name), None)

    def _per_weightupdate(self) -> tuple[Counter | Gauge | Histogram, ...]:
        return (
            self.updates_total,
            self.update_phase,
            self.replicas,
            self.progress_deadline,
            self.last_progress,
            self.rollout_duration,
            self.unit_duration,
            self.verification_failures,
            self.last_success,
            self.drained_since,
            self.agent_unreachable,
            self.pod_state,
            self.agent_token_unavailable,
        )

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def observe_status(
        self,
        namespace: str,
        name: str,
        phase: Phase,
        counts: ReplicaCounts,
        deadline_seconds: int,
        last_progress: float | None,
    ) -> None:
        self.observe_phase(namespace, name, phase)
        for state, value in counts.model_dump().items():
            self.replicas.labels(namespace, name, state).set(value)
        self.progress_deadline.labels(namespace, name).set(deadline_seconds)
        if last_progress is not None:
            self.last_progress.labels(namespace, name).set(last_progress)

    def observe_phase(self, namespace: str, name: str, phase: Phase) -> None:
        """The phase gauge alone: also for a WeightUpdate whose spec is invalid (phase
        ``Failed``, ``InvalidSpec``), which has no plan and no counts, but must raise the
        ``WeightrollUpdateFailed`` alert like any other failure."""
        for p in Phase:
            self.update_phase.labels(namespace, name, p.value).set(1 if p is phase else 0)

    def observe_transition(
        self, namespace: str, name: str, old: Phase | None, new: Phase, duration: float | None
    ) -> None:
        """Count a finished rollout when the phase enters a terminal phase."""
        if old is new:
            return
        outcome = {
            Phase.SUCCEEDED: "succeeded",
            Phase.FAILED: "failed",
            Phase.ROLLED_BACK: "rolled_back",
        }.get(new)
        if outcome is None:
            return
        self.updates_total.labels(namespace, name, outcome).inc()
        if duration is not None:
            self.rollout_duration.labels(namespace, name).observe(duration)
        if new is Phase.SUCCEEDED:
            import time

            self.last_success.labels(namespace, name).set(time.time())

    def observe_token(self, namespace: str, name: str, reason: str | None) -> None:
        """Set the token gauge for ``reason`` (``credentials.py``); ``None``: readable again,
        every series of this WeightUpdate is removed."""
        for key in list(self._token_reasons.get((namespace, name), set())):
            if key != reason:
                with contextlib.suppress(KeyError):
                    self.agent_token_unavailable.remove(namespace, name, key)
        if reason is None:
            self._token_reasons.pop((namespace, name), None)
            return
        self.agent_token_unavailable.labels(namespace, name, reason).set(1)
        self._token_reasons[(namespace, name)] = {reason}

    def observe_admitted(self, namespace: str) -> None:
        """Count one pod admitted (``domain/admission.py``)."""
        self.pods_admitted.labels(namespace).inc()

    def observe_units(
        self,
        namespace: str,
        name: str,
        finished: Mapping[str, str],
        durations: Mapping[str, float],
        reasons: Mapping[str, str],
    ) -> None:
        for unit, outcome in finished.items():
            if unit in durations:
                self.unit_duration.labels(namespace, name, outcome).observe(durations[unit])
        for reason in reasons.values():
            short = reason.split(":", 1)[0].split(" ")[-1] or "Unknown"
            self.verification_failures.labels(namespace, name, short).inc()

    def observe_pods(
        self,
        namespace: str,
        name: str,
        drained_since: Mapping[str, float],
        unreachable: Mapping[str, bool],
    ) -> None:
        """Per-pod gauges; series of pods no longer reported are removed (no stale series)."""
        key = (namespace, name)
        for gauge, values, seen in (
            (self.drained_since, drained_since, self._drained),
            (
                self.agent_unreachable,
                {p: 1.0 if d else 0.0 for p, d in unreachable.items()},
                self._unreachable,
            ),
        ):
            for pod, value in values.items():
                gauge.labels(namespace, name, pod).set(value)
            for gone in seen.get(key, set()) - set(values):
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, name, gone)
            seen[key] = set(values)

    def observe_pod_states(
        self, namespace: str, name: str, states: Mapping[str, tuple[str, str]]
    ) -> None:
        """One series per selected pod: ``pod -> (state, version)``, the previous one removed.

        ``state`` is the unit state of the pod's weight-state annotation (``Pending`` for a pod
        never touched), ``version`` that annotation's version (``""`` when none): bounded by the
        fleet size, one series per pod at any time.
        """
        key = (namespace, name)
        before = self._pod_states.get(key, {})
        for pod, old in before.items():
            if states.get(pod) != old:
                with contextlib.suppress(KeyError):
                    self.pod_state.remove(namespace, name, pod, *old)
        for pod, (state, version) in states.items():
            self.pod_state.labels(namespace, name, pod, state, version).set(1)
        self._pod_states[key] = dict(states)
