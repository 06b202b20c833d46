"""The invariants of a rollout, judged from the simulated cluster (issue 27 A; docs/
architecture.md, "The simulation tier").

Each check reads the ground truth — the API server's pod objects, kubelet's ``Ready``, the ranks
of every simulated pod and what its agent says — never the operator's own view, and returns the
violations it finds as :class:`Violation` values (empty: the invariant holds).

* **(a) budget** (:func:`budget`): per WeightUpdate, the units of the pods it selects that are not
  Ready *because of a rollout* (our gate False, or the agent running an update) and not unready
  for an outside reason (a readiness blip, vLLM down; a pod that has not served since it was
  created, or whose weights the cluster changed since it last did) number at most the largest
  ``maxUnavailable`` among the WeightUpdates that select any of those pods (two rollouts over one
  fleet share it). A budget lowered mid-rollout binds once the count has come down to it.
* **(b) verified** (:func:`verified`): a Ready pod (kubelet's rule: containers — the agent's
  ``/readyz`` among them — ready and our gate True) serves exactly the weights it served when its
  gate was last set True (versions *and* the commit that loaded them), and a pod whose
  ``weight-state`` says Verified/RolledBack serves that version and its agent says so. A change of
  the weights under a Ready pod by the cluster (a container restart onto boot weights) is excused
  for ``grace`` operator passes that could see it, or until the operator's answer is complete:
  the gate set True again and the record agreeing (the machine's ``_regated``).
* **(c) claims** (:func:`claims`): an agent runs an update only for the WeightUpdate that owns the
  pod (``weightroll.io/owner``) under the id its ``weight-state`` records; no status lists an
  ``Updating`` pod that does not exist right after a pass that saw the whole cluster
  (:func:`phantoms`).
* **(d) liveness** (:func:`liveness`): once the faults stop and passes keep running, every
  WeightUpdate reaches a terminal phase (``Succeeded``, ``Failed``, ``RolledBack``) or a named halt
  (an ``abortReason``), and every pod it selects serves its version or is listed in its status
  with a reason; a WeightUpdate that finished (``Succeeded``) neither rolls the fleet back nor
  halts on its deadline until its spec changes (:func:`finished_stays_finished`). A WeightUpdate
  that selects no pod may rest in ``Pending``; a named halt accounts for the ``Pending`` pods it
  left untouched, and a WeightUpdate ``Blocked`` by pods a halted one owns rests on that halt
  (failed units stay owned: ``domain.ownership``). "Its version" is that of the WeightUpdate
  created last among those selecting the pod (:func:`governing`).
* **(e) status** (:func:`status_agrees`): after a pass that saw the whole cluster and whose writes
  all landed, every pod its status lists as ``Verified`` serves the listed version with our gate
  True, and ``Succeeded`` means every pod it governs serves ``spec.version``, or (after the
  rollout finished) is listed ``Failed`` with its reason under ``Degraded=True``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from weightroll_operator.api.v1alpha1 import parse_spec, resolve_max_unavailable
from weightroll_operator.domain.fleet import matches
from weightroll_operator.domain.model import (
    ANNOTATION_OWNER,
    ANNOTATION_WEIGHT_STATE,
    UnitState,
    WeightState,
)

from engine_agent.protocol import AgentState
from tests.harness.sim.agents import SimPod
from tests.harness.sim.cluster import SimApiServer

__all__ = [
    "Violation",
    "budget",
    "claims",
    "finished_stays_finished",
    "governing",
    "liveness",
    "phantoms",
    "selected",
    "status_agrees",
    "verified",
]

#: What a pod's ranks hold: versions, the commits that produced them, all clean.
Fingerprint = tuple[frozenset[str], frozenset[str | None], bool]

TERMINAL_PHASES = frozenset({"Succeeded", "Failed", "RolledBack"})


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which (``a``..``e``), and what the cluster showed."""

    invariant: str
    message: str

    def __str__(self) -> str:
        return f"({self.invariant}) {self.message}"


def weight_state(pod: Mapping[str, Any]) -> WeightState | None:
    raw = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_WEIGHT_STATE)
    return WeightState.from_json(raw) if raw else None


def selected(server: SimApiServer, body: Mapping[str, Any]) -> list[str]:
    """Names of the pods a WeightUpdate selects now (its selector, or its owner annotation)."""
    try:
        spec = parse_spec(body.get("spec"))
    except ValueError:
        return []
    owner = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
    return sorted(
        name
        for name, pod in server.pods.items()
        if matches(spec.selector, pod["metadata"]["labels"])
        or pod["metadata"]["annotations"].get(ANNOTATION_OWNER) == owner
    )


def governing(server: SimApiServer, name: str, order: list[str]) -> str | None:
    """The WeightUpdate that decides what pod ``name`` should serve: of those selecting it, the
    one created last (an older one is superseded on it)."""
    for wu in reversed(order):
        body = server.weightupdates.get(wu)
        if body is not None and name in selected(server, body):
            return wu
    return None


def _externally_unready(sim: SimPod | None) -> bool:
    return sim is None or sim.blip or not sim.vllm.up or sim.agent is None


def _updating(state: AgentState | None) -> bool:
    return state is not None and state.active_update_id is not None


def rollout_unready(
    server: SimApiServer, name: str, sim: SimPod | None, state: AgentState | None
) -> bool:
    """Out of traffic because of a rollout: not Ready, drained by our gate or reloading, and
    not unready for an outside reason."""
    if server.ready(name) or _externally_unready(sim):
        return False
    return server.gate(name) is False or _updating(state)


def _budget_of(body: Mapping[str, Any], total: int) -> int:
    spec = parse_spec(body.get("spec"))
    return resolve_max_unavailable(spec.strategy.max_unavailable, max(total, 1))


def budget(
    server: SimApiServer,
    pods: Mapping[str, SimPod],
    states: Mapping[str, AgentState | None],
    latch: dict[str, int],
    exempt: Iterable[str] = (),
) -> list[Violation]:
    """(a); ``latch`` keeps, per WeightUpdate, a budget that was lowered until the count fits;
    ``exempt``: pods out of traffic for an outside reason the pod objects do not show (never
    served since created, weights changed by the cluster)."""
    exempt = set(exempt)
    out: list[Violation] = []
    chosen = {name: set(selected(server, body)) for name, body in server.weightupdates.items()}
    for name in server.weightupdates:
        mine = chosen[name]
        if not mine:
            continue
        limit = max(
            _budget_of(other, len(chosen[o]))
            for o, other in server.weightupdates.items()
            if chosen[o] & mine
        )
        out_now = sorted(
            n
            for n in mine
            if n not in exempt and rollout_unready(server, n, pods.get(n), states.get(n))
        )
        # Units the rollout holds out, whether or not something else keeps them unready too:
        # a pod drained during a blip is out by the rollout once the blip ends (the latch
        # once bound a lowered budget while a blip hid one of them, then flagged it).
        held = [
            n
            for n in mine
            if n not in exempt
            and not server.ready(n)
            and (server.gate(n) is False or _updating(states.get(n)))
        ]
        allowed = max(limit, latch.get(name, limit))
        if len(out_now) > allowed:
            out.append(
                Violation(
                    "a",
                    f"{name}: {len(out_now)} pods out of traffic by a rollout "
                    f"({', '.join(out_now)}), maxUnavailable {limit}",
                )
            )
        # a lowered budget: what was already out may finish; it binds once the count fits
        latch[name] = limit if len(held) <= limit else allowed
    return out


def verified(
    server: SimApiServer,
    pods: Mapping[str, SimPod],
    states: Mapping[str, AgentState | None],
    at_gate_on: Mapping[str, Fingerprint],
    excused: Iterable[str],
) -> list[Violation]:
    """(b); ``at_gate_on``: each pod's fingerprint when its gate was last set True;
    ``excused``: pods whose weights the cluster changed and the operator may not have seen yet."""
    out: list[Violation] = []
    excused = set(excused)
    for name in sorted(server.pods):
        sim = pods.get(name)
        if sim is None or not server.ready(name) or name in excused:
            continue
        now = sim.serving()
        then = at_gate_on.get(name)
        if then is not None and now != then and not _booted_onto(then, now, sim):
            out.append(
                Violation(
                    "b",
                    f"{name} is Ready serving {_fp(now)} but its gate was set True at {_fp(then)}",
                )
            )
        ws = weight_state(server.pods[name])
        if ws is not None and ws.state in (UnitState.VERIFIED, UnitState.ROLLED_BACK):
            state = states.get(name)
            said = state.version if state is not None else None
            if now[0] != {ws.version} or said != ws.version:
                out.append(
                    Violation(
                        "b",
                        f"{name} is Ready, weight-state {ws.state.value} at {ws.version} by "
                        f"{ws.by}, but the ranks serve {sorted(now[0])} and the agent says "
                        f"{said!r}",
                    )
                )
    return out


def _booted_onto(then: Fingerprint, now: Fingerprint, sim: SimPod) -> bool:
    """The ranks restarted onto the pod's boot weights, and those are the very weights the gate
    was set for (a rollback to them, or a reload of them): the same weights, only no commit
    names them. A cold engine at the version is the oracle itself (``plan.restore``), and a
    verdict is not contradicted by a commit its agent no longer reports (``domain.standing``).
    The sim's versions are one set of files each, so the version says which files."""
    versions, commits, clean = now
    return clean and commits == {None} and versions == then[0] == {sim.vllm.boot_version}


def _fp(fp: Fingerprint) -> str:
    versions, commits, clean = fp
    return f"{sorted(versions)} by {sorted(map(str, commits))}{'' if clean else ' (not clean)'}"


def claims(server: SimApiServer, states: Mapping[str, AgentState | None]) -> list[Violation]:
    """(c), the agents' side: every running update is the owner's recorded attempt."""
    out: list[Violation] = []
    for name in sorted(server.pods):
        state = states.get(name)
        if state is None or state.active_update_id is None:
            continue
        pod = server.pods[name]
        ws = weight_state(pod)
        owner = pod["metadata"]["annotations"].get(ANNOTATION_OWNER)
        if ws is None or ws.update_id != state.active_update_id or owner != ws.by:
            out.append(
                Violation(
                    "c",
                    f"{name}: the agent runs update {state.active_update_id} but the pod's "
                    f"owner is {owner} and its weight-state "
                    f"{'none' if ws is None else f'{ws.state.value} {ws.update_id} by {ws.by}'}",
                )
            )
    return out


def phantoms(server: SimApiServer, wu: str, excused: Iterable[str] = ()) -> list[Violation]:
    """(c), the status' side, right after a pass of ``wu`` that saw the whole cluster: no pod
    that is gone holds a unit. A ghost of a 410 re-list is ``excused`` within its grace: the
    operator asks the API server about a pod whose agent does not answer at most once per
    ``stateTtl`` (``phantoms.py``)."""
    excused = set(excused)
    body = server.weightupdates[wu]
    return [
        Violation("c", f"{wu}: status lists {result['name']} Updating; it is gone")
        for result in (body.get("status") or {}).get("pods") or []
        if result.get("state") == "Updating"
        and result.get("name") not in server.pods
        and result.get("name") not in excused
    ]


def status_agrees(
    server: SimApiServer,
    pods: Mapping[str, SimPod],
    wu: str,
    excused: Iterable[str],
    order: list[str],
) -> list[Violation]:
    """(e), right after a pass of ``wu`` that saw the whole cluster and whose writes landed."""
    out: list[Violation] = []
    excused = set(excused)
    body = server.weightupdates[wu]
    status = body.get("status") or {}
    for result in status.get("pods") or []:
        name = result.get("name")
        if result.get("state") != "Verified" or name in excused:
            continue
        # no version listed: the pod has no weight-state (it already served spec.version)
        listed = result.get("version") or body["spec"]["version"]
        sim = pods.get(name)
        if name not in server.pods or sim is None:
            out.append(Violation("e", f"{wu}: status lists {name} Verified; it is gone"))
            continue
        versions = sim.serving()[0]
        if server.gate(name) is not True or versions != {listed}:
            out.append(
                Violation(
                    "e",
                    f"{wu}: status lists {name} Verified at {listed}; gate "
                    f"{server.gate(name)}, ranks serve {sorted(versions)}",
                )
            )
    if status.get("phase") == "Succeeded":
        version = body["spec"]["version"]
        # A finished rollout keeps its verdict when a pod that joins or restarts later fails
        # to reach the version (``domain.halts``): such a pod is reported, listed ``Failed``
        # with its reason under ``Degraded=True``, never silently counted as serving.
        degraded = any(
            c.get("type") == "Degraded" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        reported = {
            r.get("name")
            for r in status.get("pods") or []
            if degraded and r.get("state") == "Failed" and r.get("reason")
        }
        for name in selected(server, body):
            sim = pods.get(name)
            if name in excused or name in reported or sim is None:
                continue
            if governing(server, name, order) != wu:
                continue
            if sim.serving()[0] != {version} or server.gate(name) is not True:
                out.append(
                    Violation(
                        "e",
                        f"{wu}: Succeeded at {version}, but {name} serves "
                        f"{sorted(sim.serving()[0])} with gate {server.gate(name)}",
                    )
                )
    return out


def finished_stays_finished(server: SimApiServer, finished: Mapping[str, int]) -> list[Violation]:
    """(d), for a rollout that finished: ``finished`` maps each WeightUpdate seen ``Succeeded``
    to the generation it succeeded at. Until its spec changes it keeps converging new and
    restarted pods: it never rolls the fleet back nor halts on its progress deadline."""
    out = []
    for wu, generation in finished.items():
        body = server.weightupdates.get(wu)
        if body is None or body["metadata"].get("generation") != generation:
            continue
        status = body.get("status") or {}
        if status.get("phase") in ("RollingBack", "RolledBack") or (
            status.get("abortReason") == "ProgressDeadlineExceeded"
        ):
            out.append(
                Violation(
                    "d",
                    f"{wu} finished (Succeeded at generation {generation}), then "
                    f"{status.get('phase')} ({status.get('abortReason')}): "
                    f"{status.get('message', '')!r}",
                )
            )
    return out


def _halted(body: Mapping[str, Any] | None) -> bool:
    status = (body or {}).get("status") or {}
    return bool(status.get("abortReason")) or status.get("phase") in ("Failed", "RolledBack")


def _held_by_a_halt(server: SimApiServer, wu: str, body: Mapping[str, Any]) -> bool:
    """``wu`` is ``Blocked`` by pods a halted WeightUpdate owns (its failed units stay owned
    and drained, and block every other WeightUpdate selecting them: ``domain.ownership``). It
    rests on that halt until a person retries or deletes the halted one: a named halt too."""
    status = body.get("status") or {}
    blocked = any(
        c.get("type") == "Blocked" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )
    mine = f"{body['metadata']['namespace']}/{wu}"
    owners = {
        server.pods[name]["metadata"]["annotations"].get(ANNOTATION_OWNER)
        for name in selected(server, body)
    } - {None, mine}
    by_name = {f"{b['metadata']['namespace']}/{n}": b for n, b in server.weightupdates.items()}
    return blocked and bool(owners) and all(_halted(by_name.get(o)) for o in owners)


def liveness(server: SimApiServer, pods: Mapping[str, SimPod], order: list[str]) -> list[Violation]:
    """(d), once the faults stopped and the operator had its passes."""
    out: list[Violation] = []
    for wu, body in sorted(server.weightupdates.items()):
        status = body.get("status") or {}
        phase = status.get("phase")
        total = (status.get("replicas") or {}).get("total", 0)
        #: a named halt: its own, or that of the halted WeightUpdate whose pods block it
        halted = _halted(body) or _held_by_a_halt(server, wu, body)
        if phase not in TERMINAL_PHASES and not halted and total:
            out.append(Violation("d", f"{wu}: still {phase} ({status.get('message', '')!r})"))
        version = body["spec"]["version"]
        #: pods the status accounts for: with a reason, or in a state that is one
        listed = {
            r.get("name")
            for r in status.get("pods") or []
            if r.get("reason")
            or r.get("state") not in ("Verified", "Updating", "Pending")
            # a named halt accounts for the pods it left untouched
            or (halted and r.get("state") == "Pending")
        }
        for name in selected(server, body):
            if governing(server, name, order) != wu:
                continue  # superseded here by a later WeightUpdate
            sim = pods.get(name)
            serves = sim is not None and sim.serving()[0] == {version} and server.ready(name)
            if not serves and name not in listed:
                what = "gone" if sim is None else f"{sorted(sim.serving()[0])}"
                out.append(
                    Violation(
                        "d",
                        f"{wu} ({phase}): {name} serves {what} (Ready {server.ready(name)}), "
                        f"not {version}, and the status gives no reason",
                    )
                )
    return out
