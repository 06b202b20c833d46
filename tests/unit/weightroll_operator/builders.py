"""Small builders for planner tests: pods, agents, specs (pure values, no I/O)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from weightroll_operator.api.v1alpha1 import WeightUpdateSpec
from weightroll_operator.domain.model import (
    AgentView,
    OwnerKey,
    PodView,
    SourceRef,
    UnitState,
    UpdateId,
    UpdateView,
    WeightState,
)
from weightroll_operator.domain.plan import (
    Fleet,
    Persisted,
    Plan,
    plan,
    queries,
    target_source,
)
from weightroll_operator.domain.plan.classify import Seen, classify_fleet

from engine_agent.protocol import UpdatePhase

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
ME = OwnerKey("ns/wu")
OTHER = OwnerKey("ns/other")
#: What a pass at ``spec().version`` persisted before anything happened.
V2 = Persisted(target_version="v2")
V1_SRC = SourceRef(uri="/weights/v1")
V2_SRC = SourceRef(uri="/weights/v2")


def spec(**strategy: Any) -> WeightUpdateSpec:
    extra = strategy.pop("_spec", {})
    return WeightUpdateSpec.model_validate(
        {
            "selector": {"matchLabels": {"app": "llm"}},
            "version": "v2",
            "source": {"uri": "/weights/v2"},
            "strategy": strategy,
            **extra,
        }
    )


def state(
    st: UnitState = UnitState.DRAINING,
    *,
    version: str = "v2",
    by: OwnerKey = ME,
    started: str = "2026-01-01T11:59:00Z",
    **kw: Any,
) -> WeightState:
    kw.setdefault("previous_version", "v1")
    kw.setdefault("previous_source", V1_SRC)
    kw.setdefault("source", SourceRef(uri=f"/weights/{version}"))
    return WeightState(
        state=st,
        by=by,
        version=version,
        update_id=UpdateId(kw.pop("update_id", f"wu-{version}")),
        started_at=started,
        **kw,
    )


def pod(
    name: str,
    *,
    ready: bool = True,
    gate: bool | None = True,
    st: WeightState | None = None,
    owner: OwnerKey | None = None,
    unit: str | None = None,
    labels: dict[str, str] | None = None,
) -> PodView:
    if owner is None and st is not None and st.state.running:
        owner = st.by
    return PodView(
        name=name,
        namespace="ns",
        unit=unit or name,
        ready=ready,
        gate=gate,
        owner=owner,
        state=st,
        ip="10.0.0.1",
        port=8470,
        labels=labels or {"app": "llm"},
    )


def agent(
    version: str | None = None,
    *,
    ready: bool = True,
    phase: UpdatePhase | None = None,
    **kw: Any,
) -> AgentView:
    """An agent observation. A ``Committed`` update is live by default (the ranks serve it,
    committed by that id, ready), as the real agent reports right after a commit; pass
    ``version=`` / ``committed_update_id=`` to describe one whose ranks changed since."""
    update = None
    update_version = kw.pop("update_version", "v2")
    update_id = kw.pop("update_id", "wu-v2")
    reasons = tuple(kw.pop("reasons", ()))
    committed = phase is UpdatePhase.COMMITTED
    if version is None:
        version = update_version if committed else "v1"
    kw.setdefault("committed_update_id", update_id if committed else None)
    kw.setdefault("engine_seen", bool(version))  # no version and no rank reports: booting
    if phase is not None:
        update = UpdateView(
            id=update_id,
            phase=phase,
            version=update_version,
            committed=committed,
            reasons=reasons,
        )
    return AgentView(
        reachable=kw.pop("reachable", True),
        version=version,
        ready=ready,
        source=kw.pop("source", SourceRef(uri=f"/weights/{version}") if version else None),
        update=update,
        clean=kw.pop("clean", True),
        **kw,
    )


def run(
    s: WeightUpdateSpec,
    pods: list[PodView],
    agents: dict[str, AgentView] | None = None,
    persisted: Persisted | None = None,
    *,
    step_limit: int | None = None,
) -> Plan:
    # Like reconcile: the planner only sees the agents that queries() says to ask.
    persisted = persisted or Persisted(target_version="v2")
    asked = queries(tuple(pods), ME, s.version, target_source(s), persisted.retried_at)
    seen = {k: v for k, v in (agents or {}).items() if k in asked}
    fleet = Fleet(name="wu", owner=ME, pods=tuple(pods), agents=seen)
    return plan(s, fleet, persisted, NOW, step_limit=step_limit)


def summary(p: Plan) -> list[tuple[str, str]]:
    """(action type, pod or reason) pairs, Emit reasons included: compact goldens."""
    out = []
    for a in p.actions:
        target = getattr(a, "pod", None)
        out.append((type(a).__name__, target.name if target is not None else a.reason))  # type: ignore[attr-defined]
    return out


def classified(
    pods: list[PodView], agents: dict[str, AgentView] | None = None, **strategy: Any
) -> tuple[WeightUpdateSpec, Fleet, Seen]:
    """A spec, a fleet of ``pods`` and step 1's view of them (``classify_fleet``), for the
    table tests of the steps after it."""
    s = spec(**strategy)
    fleet = Fleet(name="wu", owner=ME, pods=tuple(pods), agents=agents or {})
    return s, fleet, classify_fleet(s, fleet, V2)
