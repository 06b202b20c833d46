"""What a pass reports: the status patch, the phase Event and the metrics.

House rule 7: the status is computed in full every pass and merge-patched only when it
changed (``domain/status.py`` ``status_patch``). An invalid spec or an unreadable token Secret
is reported the same way, with the gauges that drive the alerts (without the phase gauge the
``WeightrollUpdateFailed`` alert never fired for an invalid spec).

The reporter keeps no state: what outlives a pass is in the CR status and in ``metrics``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from weightroll_operator.api.v1alpha1 import Phase, WeightUpdateSpec, WeightUpdateStatus
from weightroll_operator.apply import ApplyContext, apply
from weightroll_operator.credentials import token_problem, with_token_condition
from weightroll_operator.domain.actions import Emit, Settle
from weightroll_operator.domain.conditions import Reason
from weightroll_operator.domain.model import AgentView, OwnerKey, UnitState
from weightroll_operator.domain.plan import Plan, parse_time
from weightroll_operator.domain.status import invalid_status, status_patch
from weightroll_operator.errors import KubeError
from weightroll_operator.metrics import Metrics
from weightroll_operator.ports import KubePort

__all__ = ["Reporter"]


@dataclass
class Reporter:
    """Writes a WeightUpdate's status (through ``kube``) and its series (to ``metrics``)."""

    kube: KubePort
    metrics: Metrics | None = None

    async def report(
        self,
        ctx: ApplyContext,
        raw_status: Mapping[str, Any],
        old: WeightUpdateStatus | None,
        new: WeightUpdateStatus,
        spec: WeightUpdateSpec,
        the_plan: Plan,
        agents: Mapping[str, AgentView],
        unwritten: frozenset[str],
    ) -> bool:
        """Report one pass: ``new`` (its token condition cleared), a phase Event when the phase
        changed, and the metrics. Returns whether the status was written.

        ``unwritten``: pods with an action that did not happen (their failure is counted when
        it is written, a later pass).

        Raises:
            KubeError: the status could not be written (no Event, no metrics then).
        """
        namespace, name = ctx.namespace, ctx.name
        status = with_token_condition(new, None, ctx.now)
        if self.metrics is not None:
            self.metrics.observe_token(namespace, name, None)
        written = await self.write_status(namespace, name, raw_status, status)
        if old is None or old.phase is not status.phase:
            await _phase_event(ctx, old, status)
        self._observe_metrics(namespace, name, spec, the_plan, old, status, agents, ctx, unwritten)
        return written

    async def write_status(
        self,
        namespace: str,
        name: str,
        raw_status: Mapping[str, Any],
        status: WeightUpdateStatus,
    ) -> bool:
        """Merge-patch ``status`` over ``raw_status`` if anything changed; whether it did."""
        patch = status_patch(dict(raw_status), status)
        if patch is None:
            return False
        await self.kube.patch_weightupdate_status(namespace, name, patch)
        return True

    async def invalid(
        self,
        namespace: str,
        name: str,
        raw_status: Mapping[str, Any],
        old_status: WeightUpdateStatus | None,
        message: str,
        generation: int | None,
        now: datetime,
    ) -> None:
        """Status ``Failed`` with ``InvalidSpec``, and the phase gauge with it: without the
        gauge the ``WeightrollUpdateFailed`` alert never fired for an invalid spec."""
        status = invalid_status(old_status, message, generation, now)
        await self.write_status(namespace, name, raw_status, status)
        if self.metrics is not None:
            self.metrics.observe_phase(namespace, name, status.phase)

    async def token_unavailable(
        self,
        namespace: str,
        name: str,
        spec: WeightUpdateSpec,
        raw_status: Mapping[str, Any],
        old_status: WeightUpdateStatus | None,
        error: KubeError,
        now: datetime,
    ) -> None:
        """Report a token Secret that cannot be read (``credentials.py``); nothing else moves."""
        ref = spec.agent.token_secret_ref
        problem = None if ref is None else token_problem(error, namespace, ref)
        if problem is None:
            return  # transient (5xx, connection): retried without a word in status
        status = with_token_condition(old_status or WeightUpdateStatus(), problem, now)
        await self.write_status(namespace, name, raw_status, status)
        if self.metrics is not None:
            self.metrics.observe_token(namespace, name, problem.reason)

    def forget(self, namespace: str, name: str, keep_drained: Mapping[str, float]) -> None:
        """Drop the series of a deleted WeightUpdate but the drained series of the pods it
        left drained (``keep_drained``: pod -> drained since)."""
        if self.metrics is not None:
            self.metrics.forget(namespace, name, keep_drained=dict(keep_drained))

    def _observe_metrics(
        self,
        namespace: str,
        name: str,
        spec: WeightUpdateSpec,
        the_plan: Plan,
        old: WeightUpdateStatus | None,
        new: WeightUpdateStatus,
        agents: Mapping[str, AgentView],
        ctx: ApplyContext,
        unwritten: frozenset[str],
    ) -> None:
        m = self.metrics
        if m is None:
            return
        now = ctx.now
        last = parse_time(new.last_progress_time)
        m.observe_status(
            namespace,
            name,
            new.phase,
            new.replicas,
            spec.strategy.progress_deadline_seconds,
            last.timestamp() if last else None,
        )
        start = parse_time(new.start_time)
        # A Succeeded rollout converging a new pod goes back through Progressing: count the
        # rollout once, when it first completes.
        reconverged = new.phase is Phase.SUCCEEDED and old is not None and old.completion_time
        m.observe_transition(
            namespace,
            name,
            new.phase if reconverged else old.phase if old is not None else None,
            new.phase,
            (now - start).total_seconds() if start else None,
        )
        new_failures = {
            a.pod.name: a.state.reason
            for a in the_plan.actions
            if isinstance(a, Settle)
            and a.transition
            and a.state.state is UnitState.FAILED
            and a.pod.name not in unwritten  # counted when it is written (a later pass)
        }
        m.observe_units(namespace, name, the_plan.finished, the_plan.durations, new_failures)
        drained: dict[str, float] = {}
        for pod in the_plan.pods.values():
            st = pod.state
            held = st is not None and st.by == OwnerKey(f"{namespace}/{name}")
            if held and st is not None and (st.state.in_flight or st.state is UnitState.FAILED):
                started = parse_time(st.started_at)
                if started is not None:
                    drained[pod.name] = started.timestamp()
        m.observe_pods(namespace, name, drained, {n: not a.reachable for n, a in agents.items()})
        m.observe_pod_states(
            namespace,
            name,
            {
                pod.name: (
                    (pod.state.state.value, pod.state.version) if pod.state else ("Pending", "")
                )
                for pod in the_plan.pods.values()
            },
        )


async def _phase_event(
    ctx: ApplyContext, old: WeightUpdateStatus | None, new: WeightUpdateStatus
) -> None:
    before = old.phase.value if old is not None else "None"
    warning = new.phase in (Phase.FAILED, Phase.ROLLING_BACK)
    emit = Emit(Reason.PHASE_CHANGED, f"Phase changed from {before} to {new.phase.value}", warning)
    await apply([emit], ctx)
