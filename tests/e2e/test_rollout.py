"""End to end on the real kube-apiserver: the chart, the operator as its ServiceAccount, three
real vLLM CPU engines with their agents (issue 5, acceptance 3 and 4).

The tests of this module share one fleet and run in file order, each starting from what the
previous one left (every pod serving the version named in its docstring):

1. ``v1 -> v2`` succeeds: every pod Ready again and serving the new weights; a reference pod
   that booted v2 cold serves exactly the same completions (then it is deleted).
2. ``v2 -> v3`` with one pod's copy of v3 corrupt and ``onFailure: Rollback``: every touched pod
   returns to v2 and serves traffic again.
3. ``v2 -> v4`` with one pod's copy of v4 corrupt and ``onFailure: Halt``: the rollout stops,
   that pod stays NotReady (drained), the alert metrics show it.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.e2e.conftest import COLD, FIRST_UPDATE, GATE, NAMESPACE, PODS, Fleet, port_open

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.server,
    pytest.mark.needs_reference_pod,
    pytest.mark.timeout(900),
    pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning"),
]

PROMPTS = ("Weights are reloaded in place", "The quick brown fox")
#: Completions per version, recorded by the tests (the module's scenario state).
SEEN: dict[str, dict[str, tuple[str, list[float]]]] = {}


def _serve(fleet: Fleet, pods: tuple[str, ...] = PODS) -> dict[str, tuple[str, list[float]]]:
    """Each pod's greedy completions of PROMPTS (texts joined, token logprobs)."""
    out: dict[str, tuple[str, list[float]]] = {}
    for pod in pods:
        texts, logprobs = [], []
        for prompt in PROMPTS:
            try:
                text, lp = fleet.complete(pod, prompt)
            except OSError as e:  # a timeout or a refused connection: say what the pod did
                state = fleet.agent_state(pod)
                raise AssertionError(
                    f"{pod} did not complete {prompt!r}: {e!r}\nagent: {state}\n"
                    f"{fleet.pod_logs(pod)}"
                ) from e
            texts.append(text)
            logprobs.extend(lp)
        out[pod] = ("|".join(texts), logprobs)
    return out


def _same(a: tuple[str, list[float]], b: tuple[str, list[float]]) -> bool:
    return a[0] == b[0] and all(
        math.isclose(x, y, abs_tol=1e-3) for x, y in zip(a[1], b[1], strict=True)
    )


def _uniform(served: dict[str, tuple[str, list[float]]]) -> tuple[str, list[float]]:
    first = next(iter(served.values()))
    for pod, got in served.items():
        assert _same(got, first), f"{pod} serves other weights than its peers: {served}"
    return first


def _labels(fleet: Fleet, name: str) -> dict[str, str]:
    return {"namespace": NAMESPACE, "name": name}


def test_rollout_reaches_succeeded_and_serves_new_weights(fleet: Fleet) -> None:
    """v1 -> v2: Succeeded, every pod Ready, every pod serves the same, new completions."""
    SEEN["v1"] = {"all": _uniform(_serve(fleet))}
    assert FIRST_UPDATE == "v2"  # a checkpoint of the dev cluster
    began = time.monotonic()
    with fleet.sample_ready() as sampled:
        fleet.apply_weightupdate("to-v2", "v2")
        status = fleet.wait_phase("to-v2", "Succeeded", "Failed", timeout=240)
        try:
            fleet.wait_pods("Ready", "True", PODS, timeout=30)
        except AssertionError as e:
            agents = {pod: fleet.agent_state(pod) for pod in PODS}
            raise AssertionError(f"{e}\nstatus: {status}\nagents: {agents}") from None
    fleet.timings["rollout_v2_s"] = time.monotonic() - began
    assert status["phase"] == "Succeeded", status
    # the budget, from the pods' real Ready conditions: maxUnavailable 1 (issue 11, C); every
    # pod was drained for its reload, and never two at once
    assert sampled.went_out == set(PODS), sampled.went_out
    assert sampled.most_out == 1, (sampled.most_out, sampled.worst)
    assert status["replicas"]["updated"] == len(PODS), status
    fleet.wait_pods("Ready", "True", PODS, timeout=30)
    for pod in PODS:
        assert fleet.condition(pod, GATE) == "True"
        labels = fleet.pod(pod)["metadata"]["labels"]
        assert labels.get("weightroll.io/weight-version") == "v2", labels
        state = fleet.agent_state(pod)
        assert state["version"] == "v2" and state["ready"], state
    v2 = _uniform(_serve(fleet))
    assert v2[0] != SEEN["v1"]["all"][0], "the completions did not change with the new weights"
    SEEN["v2"] = {"all": v2}
    assert (
        fleet.metric("weightroll_updates_total", outcome="succeeded", **_labels(fleet, "to-v2"))
        == 1
    )
    assert fleet.metric("weightroll_replicas", state="updated", **_labels(fleet, "to-v2")) == len(
        PODS
    )


def test_reloaded_weights_serve_like_a_cold_engine(fleet: Fleet) -> None:
    """A pod that booted v2 cold (started with the fleet) serves exactly what the reloaded pods
    serve; deleting it stops its engine."""
    if "v2" not in SEEN:
        pytest.skip("needs the fleet on v2 (test_rollout_reaches_succeeded_and_serves_new_weights)")
    try:
        fleet.wait_serving(COLD)
        cold = _serve(fleet, (COLD,))[COLD]
        assert _same(cold, SEEN["v2"]["all"]), (cold, SEEN["v2"]["all"])
    finally:
        fleet.kubectl("delete", "pod", COLD, "-n", NAMESPACE, "--wait=false")
    deadline = time.monotonic() + 60
    while port_open(fleet.info.host(COLD), 8000):
        assert time.monotonic() < deadline, "the deleted pod's vLLM still serves"
        time.sleep(0.5)


def test_corrupt_checkpoint_rolls_back_every_touched_pod(fleet: Fleet) -> None:
    """v2 -> v3, the last pod's v3 corrupt, onFailure Rollback: all pods back on v2, Ready."""
    if "v2" not in SEEN:
        pytest.skip("needs the fleet on v2 (test_rollout_reaches_succeeded_and_serves_new_weights)")
    fleet.publish("v3", seed=2)
    bad = PODS[-1]
    fleet.corrupt(bad, "v3")
    with fleet.sample_ready() as sampled:
        fleet.apply_weightupdate("to-v3", "v3", on_failure="Rollback")
        status = fleet.wait_phase("to-v3", "RolledBack", "Failed", "Succeeded", timeout=300)
    assert status["phase"] == "RolledBack", status
    assert sampled.most_out <= 1, (sampled.most_out, sampled.worst)
    failed = [p for p in status.get("pods") or [] if p.get("name") == bad]
    assert failed, status
    fleet.wait_pods("Ready", "True", PODS, timeout=60)
    for pod in PODS:
        state = fleet.agent_state(pod)
        assert state["version"] == "v2" and state["ready"], (pod, state)
    assert _same(_uniform(_serve(fleet)), SEEN["v2"]["all"]), "pods do not serve v2 again"
    labels = _labels(fleet, "to-v3")
    assert fleet.metric("weightroll_updates_total", outcome="rolled_back", **labels) == 1
    assert fleet.metric("weightroll_update_phase", phase="RolledBack", **labels) == 1
    assert (fleet.metric("weightroll_verification_failures_total") or 0) >= 0


def test_corrupt_checkpoint_halts_and_keeps_the_pod_drained(fleet: Fleet) -> None:
    """v2 -> v4, the middle pod's v4 corrupt, onFailure Halt: Failed, that pod NotReady."""
    if "v2" not in SEEN:
        pytest.skip("needs the fleet on v2 (test_rollout_reaches_succeeded_and_serves_new_weights)")
    fleet.publish("v4", seed=3)
    bad = PODS[1]
    fleet.corrupt(bad, "v4")
    with fleet.sample_ready() as sampled:
        fleet.apply_weightupdate("to-v4", "v4", on_failure="Halt")
        status = fleet.wait_phase("to-v4", "Failed", "Succeeded", timeout=300)
    assert status["phase"] == "Failed", status
    assert sampled.most_out <= 1, (sampled.most_out, sampled.worst)
    assert status["replicas"]["failed"] == 1, status
    assert fleet.condition(bad, GATE) == "False"
    assert fleet.condition(bad, "Ready") == "False"
    # the agent holds the replica: its /readyz fails, and kubelet (failureThreshold over
    # periodSeconds) reports the container unready
    fleet.wait_pods("ContainersReady", "False", (bad,), timeout=60)
    state = fleet.agent_state(bad)
    assert state["version"] == "v2" and not state["ready"], state
    others = tuple(p for p in PODS if p != bad)
    fleet.wait_pods("Ready", "True", others, timeout=30)
    labels = _labels(fleet, "to-v4")
    assert fleet.metric("weightroll_updates_total", outcome="failed", **labels) == 1
    assert fleet.metric("weightroll_update_phase", phase="Failed", **labels) == 1
    assert fleet.metric("weightroll_replicas", state="failed", **labels) == 1
    drained = fleet.metric("weightroll_replica_drained_since_timestamp_seconds", pod=bad, **labels)
    assert drained is not None and 0 < drained <= time.time(), drained


def test_deleting_a_halted_weightupdate_releases_and_keeps_the_drained_pod_alerting(
    fleet: Fleet,
) -> None:
    """Delete ``to-v4`` (halted, its corrupt pod drained): the finalizer releases every pod it
    owns before the object goes; the pod its agent still holds stays drained, its drained
    series stays exported (the alert keeps firing) and an Event says so (issue 11, E)."""
    if "v2" not in SEEN:
        pytest.skip("needs the fleet on v2 (test_rollout_reaches_succeeded_and_serves_new_weights)")
    bad = PODS[1]
    fleet.kubectl(
        "delete", "weightupdates.weightroll.io", "to-v4", "-n", NAMESPACE, "--timeout=120s"
    )
    gone = fleet.kubectl(
        "get", "weightupdates.weightroll.io", "to-v4", "-n", NAMESPACE, check=False
    )
    assert "to-v4" not in gone, gone
    pod = fleet.pod(bad)
    annotations = pod["metadata"].get("annotations") or {}
    assert "weightroll.io/owner" not in annotations, annotations
    assert json.loads(annotations["weightroll.io/weight-state"])["state"] == "Failed"
    assert fleet.condition(bad, GATE) == "False"  # its agent holds the replica: stays drained
    assert not fleet.agent_state(bad)["ready"]
    drained = fleet.metric(
        "weightroll_replica_drained_since_timestamp_seconds", pod=bad, **_labels(fleet, "to-v4")
    )
    assert drained is not None and 0 < drained <= time.time(), drained
    assert fleet.metric("weightroll_update_phase", phase="Failed", **_labels(fleet, "to-v4")) in (
        None,
        0,
    )
    events = fleet.kubectl(
        "get", "events", "-n", NAMESPACE, "--field-selector", "involvedObject.name=to-v4"
    )
    assert "LeftDrained" in events, events


def test_flipping_back_to_an_earlier_version_reloads_every_pod(fleet: Fleet) -> None:
    """One WeightUpdate ``flip``: v1, then v2, then v1 again. The last v1 is a new attempt on
    every pod: the agents' records of the first v1 cannot pass for it, every pod really serves
    v1 again (the boot weights' completions), committed by an attempt id never used before
    (issue 11, A / finding 1)."""
    if "v2" not in SEEN:
        pytest.skip("needs the fleet on v2 (test_rollout_reaches_succeeded_and_serves_new_weights)")
    committed: dict[str, list[str]] = {pod: [] for pod in PODS}
    for version in ("v1", "v2", "v1"):
        with fleet.sample_ready() as sampled:
            fleet.apply_weightupdate("flip", version)
            status = fleet.wait_phase("flip", "Succeeded", "Failed", timeout=300)
            fleet.wait_pods("Ready", "True", PODS, timeout=60)
        assert status["phase"] == "Succeeded" and status["targetVersion"] == version, status
        assert sampled.most_out <= 1, (sampled.most_out, sampled.worst)
        for pod in PODS:
            state = fleet.agent_state(pod)
            assert state["version"] == version and state["ready"], (pod, state)
            committed[pod].append(str(state["committedUpdateId"]))
    for pod, ids in committed.items():
        assert len(set(ids)) == 3, (pod, ids)  # three attempts, three ids
    assert _same(_uniform(_serve(fleet)), SEEN["v1"]["all"]), "pods do not serve v1 again"
