"""What a real kubelet does around a rollout, judged from the Service's EndpointSlices (issue 29).

On the session's ``dev up --node real`` cluster (``conftest.py``: two vLLM pods, the operator,
a Service), each scenario steers one WeightUpdate ``roll`` (``maxUnavailable: 1``) while
:mod:`weightroll_dev.realnode.sampler` reads, back to back, the agents, the EndpointSlices and
the agents again. Verdicts over every round: at most one selected pod out of the ready
endpoints, and no ready endpoint whose agent (in both reads around the slice) serves a version
the scenario does not accept, ready and outside an update:

1. **flip-back**: ``spec.version`` moves to v3 and back while a pod loads v3; only the old and
   the new version are ever served in traffic and the fleet ends on the old one;
2. **deletion mid-rollout**: the pod loading v3 is deleted; the ReplicaSet's replacement boots
   on v1 and is never a ready endpoint before the operator brought it to v3;
3. **vLLM crash after success**: the vLLM container of a pod is killed; the kubelet restarts
   it onto the boot weights, and the pod is a ready endpoint again only at v3;
4. **a probe failure with the gate True**: one pod's agent is frozen (its ``/readyz`` probe
   times out); the pod leaves the endpoints with the gate True, the operator takes no second
   pod out while it is out, and the fleet converges once it answers again.

Scenario 2 accepts only the target for the pod that booted during the rollout: the agent's own
readiness cannot keep boot weights out of traffic (a fresh agent is ready on them), only the
operator's gate does. The rounds are judged while the scenario waits too (``_guard``), so a
broken gate fails on the slice that shows it, not on a rollout stalled by it. Root, the node
binaries and vLLM needed; else skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from weightroll_dev.realnode.sampler import budget_breaches, judge

from tests.harness.polling import poll
from tests.harness.realnode_fleet import (
    GATE,
    WEIGHTUPDATE,
    RealFleet,
    Sampling,
    condition,
    iter_out_of_endpoints,
    ready_at,
    realnode_marks,
    serving_versions,
)

pytestmark = realnode_marks()

PODS = 2
UPDATE = "roll"
BOOT = "v1"
TARGET = "v3"
Round = dict[str, Any]


@pytest.fixture(scope="module")
def base(real_fleet: RealFleet, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The version the whole fleet serves once no WeightUpdate is left (v1 on a fresh cluster,
    v2 after the rollout module)."""
    ns = real_fleet.namespace
    real_fleet.kubectl("delete", WEIGHTUPDATE, "--all", "-n", ns, "--timeout=120s")
    out = tmp_path_factory.mktemp("base") / "samples.jsonl"
    with real_fleet.sampling(out) as sampler:
        settled = sampler.wait("every pod a ready endpoint", ready_at(PODS), timeout=120)
    (version,) = serving_versions(settled)
    assert version != TARGET
    return version


def _loading(round_: Round) -> str | None:
    """The pod whose agent runs an update in this round."""
    names = {ip: name for name, ip in round_["pods"].items()}
    busy = [
        names[ip] for ip, s in round_["agents_after"].items() if (s or {}).get("activeUpdateId")
    ]
    return busy[0] if busy else None


def _first(sampler: Sampling, what: str, pick: Callable[[Round], str | None]) -> str:
    found = sampler.wait(what, lambda r: pick(r) is not None, timeout=180)
    name = pick(found)
    assert name is not None
    return name


def _guard(sampler: Sampling, accepted: tuple[str, ...], known: set[str] | None = None) -> None:
    """Fail every wait at the first unverified ready endpoint; with ``known``, a pod not in it
    (booted during the scenario) is accepted at :data:`TARGET` only."""

    def unverified(rounds: list[Round]) -> list[str]:
        names = {name for r in rounds for name in r["pods"]}
        newcomers = {n: (TARGET,) for n in names - known} if known is not None else {}
        return judge(rounds, accepted, newcomers).unverified

    sampler.guard = unverified


def _judge(
    rounds: list[Round], accepted: tuple[str, ...], accepted_for: dict[str, tuple[str, ...]]
) -> list[str]:
    """Fails on an unverified ready endpoint or a budget breach; returns the ready endpoints
    that served nothing (:class:`~weightroll_dev.realnode.sampler.Verdict`)."""
    assert len(rounds) >= 10, f"only {len(rounds)} samples"
    verdict = judge(rounds, accepted, accepted_for)
    assert not verdict.unverified, verdict.unverified[:5]
    budget = [b for r in rounds for b in budget_breaches(r, max_unavailable=1)]
    assert not budget, budget[:5]
    return verdict.dead


def test_flip_back_mid_rollout(real_fleet: RealFleet, base: str, tmp_path: Path) -> None:
    with real_fleet.sampling(tmp_path / "samples.jsonl") as sampler:
        _guard(sampler, (base, TARGET))
        sampler.wait("every pod a ready endpoint", ready_at(PODS, base))
        real_fleet.apply_weightupdate(UPDATE, TARGET)
        loading = _first(sampler, f"a pod loading {TARGET}", _loading)
        real_fleet.apply_weightupdate(UPDATE, base)
        real_fleet.wait_succeeded(UPDATE, base, sampler)
        sampler.wait(f"every pod a ready endpoint at {base}", ready_at(PODS, base), timeout=180)
    rounds = sampler.rounds()
    assert _judge(rounds, (base, TARGET), {}) == []
    assert any(iter_out_of_endpoints(rounds, loading)), f"{loading} never seen out"


def test_deleting_a_pod_mid_rollout(real_fleet: RealFleet, base: str, tmp_path: Path) -> None:
    with real_fleet.sampling(tmp_path / "samples.jsonl") as sampler:
        sampler.wait("every pod a ready endpoint", ready_at(PODS, base))
        before = set(real_fleet.pods())
        _guard(sampler, (base, TARGET), known=before)
        real_fleet.apply_weightupdate(UPDATE, TARGET)
        loading = _first(sampler, f"a pod loading {TARGET}", _loading)
        real_fleet.kubectl("delete", "pod", loading, "-n", real_fleet.namespace, "--wait=false")
        poll("the ReplicaSet's replacement", lambda: set(real_fleet.pods()) - before, 60)
        real_fleet.wait_succeeded(UPDATE, TARGET, sampler)
        final = sampler.wait(
            f"the replacement a ready endpoint at {TARGET}", ready_at(PODS, TARGET), timeout=300
        )
    rounds = sampler.rounds()
    replacements = {name for r in rounds for name in r["pods"]} - before
    assert len(replacements) == 1, replacements
    (replacement,) = replacements
    assert replacement in final["pods"] and loading not in final["pods"]
    # The replacement booted on v1: in traffic only once the operator brought it to v3.
    assert _judge(rounds, (base, TARGET), {replacement: (TARGET,)}) == []
    states = [
        r["agents_after"].get(r["pods"][replacement]) for r in rounds if replacement in r["pods"]
    ]
    assert any((s or {}).get("version") == BOOT for s in states), "never seen on boot weights"


def test_vllm_crash_after_success(real_fleet: RealFleet, tmp_path: Path) -> None:
    real_fleet.wait_succeeded(UPDATE, TARGET)
    victim = sorted(real_fleet.pods())[0]

    def vllm_restarts() -> int:
        pod = real_fleet.pods()[victim]
        (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm"]
        return int(status["restartCount"])

    with real_fleet.sampling(tmp_path / "samples.jsonl") as sampler:
        _guard(sampler, (TARGET,))
        sampler.wait("every pod a ready endpoint", ready_at(PODS, TARGET))
        restarts = vllm_restarts()
        real_fleet.ctr("tasks", "kill", "--signal", "SIGKILL",
                       real_fleet.container_id(victim, "vllm"))  # fmt: skip
        poll("the kubelet restarts vLLM", lambda: vllm_restarts() > restarts, 120)
        sampler.wait(
            f"{victim} back as a ready endpoint at {TARGET}", ready_at(PODS, TARGET), timeout=300
        )
        real_fleet.wait_succeeded(UPDATE, TARGET, sampler)
    rounds = sampler.rounds()
    # Boot weights (v1) after the restart: never in traffic, for any pod. Until the agent's
    # probe failed twice the victim stays a ready endpoint serving nothing (vLLM is down).
    dead = _judge(rounds, (TARGET,), {})
    assert all(line.startswith(victim) for line in dead), dead
    print(f"{victim}: a ready endpoint with vLLM down in {len(dead)} of {len(rounds)} rounds")
    assert any(iter_out_of_endpoints(rounds, victim)), f"{victim} never seen out"
    after_kill = [r["agents_after"].get(r["pods"][victim]) or {} for r in rounds]
    assert any(s.get("version") == BOOT for s in after_kill), "the restart was not seen on v1"


def test_probe_failure_with_the_gate_true(real_fleet: RealFleet, base: str, tmp_path: Path) -> None:
    real_fleet.wait_succeeded(UPDATE, TARGET)
    frozen, other = sorted(real_fleet.pods())
    agent = real_fleet.container_id(frozen, "weightroll-agent")
    with real_fleet.sampling(tmp_path / "samples.jsonl") as sampler:
        _guard(sampler, (TARGET, base))
        sampler.wait("every pod a ready endpoint", ready_at(PODS, TARGET))
        real_fleet.ctr("tasks", "pause", agent)  # the agent's /readyz probe now times out
        try:
            ip = real_fleet.pods()[frozen]["status"]["podIP"]
            sampler.wait(f"{frozen} out of the endpoints", lambda r: not r["endpoints"].get(ip))
            pod = real_fleet.pods()[frozen]
            assert condition(pod, GATE) == "True" and condition(pod, "Ready") == "False"
            real_fleet.apply_weightupdate(UPDATE, base)

            def seen() -> bool:
                body = real_fleet.weightupdate(UPDATE)
                return bool(
                    body.get("status", {}).get("observedGeneration")
                    == body["metadata"]["generation"]
                )

            poll("the operator saw the new version", seen, 60)
            # Three more rounds with the agent frozen: the other pod must stay in traffic.
            began = time.time()
            poll("three rounds with the agent frozen", lambda: len(sampler.since(began)) >= 3, 120)
        finally:
            real_fleet.ctr("tasks", "resume", agent)
        real_fleet.wait_succeeded(UPDATE, base, sampler)
        sampler.wait(f"every pod a ready endpoint at {base}", ready_at(PODS, base), timeout=180)
    rounds = sampler.rounds()
    assert _judge(rounds, (TARGET, base), {}) == []
    assert any(iter_out_of_endpoints(rounds, frozen)), f"{frozen} never seen out"
    assert other in rounds[-1]["pods"]
