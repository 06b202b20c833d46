"""Prometheus metrics of the sidecar (names fixed in docs/contracts.md, ``weightroll_agent_*``).

Each :class:`AgentMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`, so several
agents can live in one test process; ``GET /metrics`` renders exactly that registry.

Label values are bounded: ``phase`` is one of :data:`PHASES`, ``state`` one of the engine
states (plus ``unknown`` while vLLM cannot be reached), ``outcome`` one of :data:`OUTCOMES`, and
``reason`` a problem code from :mod:`~engine_agent.sidecar.rounds`,
:mod:`~engine_agent.sidecar.agreement` or the agent (never free text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_agent.protocol import EngineState

__all__ = ["CONTENT_TYPE", "OUTCOMES", "PHASES", "PUSH_OUTCOMES", "AgentMetrics"]

#: Phases timed per update (label ``phase`` of ``weightroll_agent_phase_duration_seconds``).
PHASES: Final = ("drain", "begin", "load", "finish", "verify", "resume")
#: Outcomes of ``weightroll_agent_updates_total``.
OUTCOMES: Final = ("committed", "failed", "aborted")
#: Outcomes of ``weightroll_agent_trainer_pushes_total`` (pushes through the native routes).
PUSH_OUTCOMES: Final = ("committed", "failed")
#: ``Content-Type`` of the text exposition format.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
#: Reported as engine state while no rank can be asked.
UNKNOWN_STATE: Final = "unknown"

_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class AgentMetrics:
    """The agent's metric families, registered in a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_state = Gauge(
            "weightroll_agent_engine_state",
            "1 for the engine state the ranks report (worst over ranks), 0 otherwise",
            ["state"],
            registry=self.registry,
        )
        self.still_true_violated = Gauge(
            "weightroll_agent_still_true_violated",
            "1 while a rank reports that what its kernels read changed after its verified "
            "commit (a stray write, vLLM's own reload): the replica is held until a full update",
            registry=self.registry,
        )
        self.ready = Gauge(
            "weightroll_agent_ready",
            "1 when every rank is committed at the expected version and generation runs",
            registry=self.registry,
        )
        self.phase_duration = Histogram(
            "weightroll_agent_phase_duration_seconds",
            "Duration of each phase of an update",
            ["phase"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.bytes_loaded = Counter(
            "weightroll_agent_bytes_loaded",
            "Checkpoint bytes loaded into live weights, summed over ranks",
            registry=self.registry,
        )
        self.verification_failures = Counter(
            "weightroll_agent_verification_failures",
            "Updates or readiness checks refused, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.updates = Counter(
            "weightroll_agent_updates",
            "Finished updates by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.pushes = Counter(
            "weightroll_agent_trainer_pushes",
            "Trainer pushes through the native weight-transfer routes, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in PUSH_OUTCOMES:
            self.pushes.labels(outcome=outcome)
        for phase in PHASES:
            self.phase_duration.labels(phase=phase)
        for outcome in OUTCOMES:
            self.updates.labels(outcome=outcome)
        self.set_engine_state(None)
        self.ready.set(0)

    def set_engine_state(self, state: EngineState | None) -> None:
        """Set the one-hot engine state gauge (``None`` = unknown)."""
        current = UNKNOWN_STATE if state is None else state.value
        for name in (*(s.value for s in EngineState), UNKNOWN_STATE):
            self.engine_state.labels(state=name).set(1 if name == current else 0)

    def track_commits(
        self,
        version: Callable[[], str | None],
        last_commit: Callable[[], float | None],
        now: Callable[[], float],
    ) -> None:
        """Export the committed version and commit age, read from the agent at scrape time.

        ``weightroll_agent_committed_version_info{version}`` is 1 for the version a verified
        commit set (absent before any is known); ``weightroll_agent_last_commit_timestamp_seconds``
        and ``weightroll_agent_seconds_since_last_commit`` are absent until the first commit.
        """
        self.registry.register(_CommitCollector(version, last_commit, now))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CommitCollector(Collector):
    def __init__(
        self,
        version: Callable[[], str | None],
        last_commit: Callable[[], float | None],
        now: Callable[[], float],
    ) -> None:
        self._version = version
        self._last_commit = last_commit
        self._now = now

    def describe(self) -> Iterator[Metric]:
        """The families without samples (so registering reads nothing from the agent)."""
        yield from self._families(None, None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._version(), self._last_commit())

    def _families(self, version: str | None, at: float | None) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "weightroll_agent_committed_version_info",
            "1 for the weight version the last verified commit set",
            labels=["version"],
        )
        if version:
            info.add_metric([version], 1)
        yield info
        stamp = GaugeMetricFamily(
            "weightroll_agent_last_commit_timestamp_seconds",
            "Unix time of the last verified commit (file update or trainer push)",
        )
        age = GaugeMetricFamily(
            "weightroll_agent_seconds_since_last_commit",
            "Seconds since the last verified commit (file update or trainer push)",
        )
        if at is not None:
            stamp.add_metric([], at)
            age.add_metric([], max(0.0, self._now() - at))
        yield stamp
        yield age
