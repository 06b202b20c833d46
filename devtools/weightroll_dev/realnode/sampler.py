"""Sample a Service's EndpointSlices and the agents behind them, inside the node's namespace.

The verdict of a rollout on the real node is read from what traffic follows: the Service's
EndpointSlices, written by the real controller-manager from the Ready conditions the real
kubelet reports. ``python -m weightroll_dev.realnode.sampler`` runs inside the node's network
namespace (pod IPs are reachable only there) and appends one JSON line per round to ``--out``
until SIGTERM:

``{"pods": {name: ip}, "agents_before": {ip: state}, "endpoints": {ip: ready},
"agents_after": {ip: state}}``

Each round reads every selected pod's agent ``GET /v1/state`` (all at once), then the
EndpointSlices, then the agents again: an endpoint counts against an agent only when *both*
reads around the slice say the pod was not serving an accepted version (:func:`judge`), so a
pod that finished its update between two reads is never blamed for the slice's lag. A ready
endpoint whose engine answers nothing (vLLM down, the probe not yet failed twice) serves no
weights: :func:`judge` lists it apart, as ``dead``.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["Verdict", "budget_breaches", "judge", "serves_nothing", "serving_accepted"]


def serving_accepted(state: Mapping[str, Any] | None, accepted: Collection[str]) -> bool:
    """Whether an agent's ``/v1/state`` (wire names, camelCase) says its pod serves one of
    ``accepted``, ready and not inside an update (``None``: the agent did not answer)."""
    return bool(
        state
        and state.get("ready") is True
        and state.get("version") in accepted
        and not state.get("activeUpdateId")
    )


def serves_nothing(state: Mapping[str, Any] | None) -> bool:
    """Whether an agent answered that no rank of its engine did (vLLM down or still booting):
    the pod serves no weights at all, and a request sent to it fails."""
    return state is not None and not state.get("version") and not state.get("ranks")


@dataclass
class Verdict:
    """Ready endpoints over a run of rounds, by what their agents said."""

    #: Serving weights the scenario does not accept (or inside an update): the promise broken.
    unverified: list[str] = field(default_factory=list)
    #: Serving nothing (the engine did not answer) while still a ready endpoint: the kubelet's
    #: readiness probe has not failed often enough yet (the chart's: every 5 s, twice).
    dead: list[str] = field(default_factory=list)


def judge(
    rounds: Iterable[Mapping[str, Any]],
    accepted: Collection[str],
    accepted_for: Mapping[str, Collection[str]] | None = None,
) -> Verdict:
    """Every ready endpoint of every round, judged by its agent's reads around the slice.

    An endpoint passes when either read says it serves an accepted version (the pod may have
    finished its update between the reads, so the slice's lag is never blamed). When neither
    read answered (a frozen agent), its last answer stands in: an agent that never answered is
    blamed. ``accepted_for`` narrows what a named pod may serve in traffic (a pod that booted
    during a rollout: its target only, never its boot weights); the others are judged by
    ``accepted``.
    """
    verdict = Verdict()
    last: dict[str, Mapping[str, Any]] = {}
    for sample in rounds:
        names = {ip: name for name, ip in sample["pods"].items()}
        for ip, ready in sample["endpoints"].items():
            name = names.get(ip, "?")
            allowed = (accepted_for or {}).get(name, accepted)
            reads = [sample["agents_before"].get(ip), sample["agents_after"].get(ip)]
            answered = [r for r in reads if r is not None] or ([last[ip]] if ip in last else [])
            if answered:
                last[ip] = answered[-1]
            if not ready or any(serving_accepted(r, allowed) for r in answered):
                continue
            line = f"{name} ({ip}) is a ready endpoint; accepted {sorted(allowed)}, agent said "
            line += " then ".join(str(r) for r in answered) if answered else "nothing"
            if answered and all(serves_nothing(r) for r in answered):
                verdict.dead.append(line)
            else:
                verdict.unverified.append(line)
    return verdict


def budget_breaches(sample: Mapping[str, Any], max_unavailable: int) -> list[str]:
    """Selected pods out of the ready endpoints, when more than ``max_unavailable`` are."""
    ready = {ip for ip, ok in sample["endpoints"].items() if ok}
    out = sorted(name for name, ip in sample["pods"].items() if ip not in ready)
    return (
        [f"{len(out)} selected pods not ready endpoints: {out}"]
        if len(out) > max_unavailable
        else []
    )


def _agent_state(ip: str, token: str) -> dict[str, Any] | None:
    request = urllib.request.Request(
        f"http://{ip}:8470/v1/state", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=3) as response:
            return dict(json.loads(response.read()))
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _agent_states(ips: Sequence[str], token: str) -> dict[str, dict[str, Any] | None]:
    """Every agent read at once: an agent that does not answer (a frozen container) costs a
    round one timeout, not one per pod, so the other pods are still read often."""
    if not ips:
        return {}
    with ThreadPoolExecutor(max_workers=len(ips)) as pool:
        return dict(zip(ips, pool.map(lambda ip: _agent_state(ip, token), ips), strict=True))


def _kubectl_json(kubeconfig: str, *args: str) -> dict[str, Any]:
    out = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args, "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return dict(json.loads(out.stdout))


def sample_once(
    kubeconfig: str, namespace: str, selector: str, service: str, token: str
) -> dict[str, Any]:
    pods = _kubectl_json(kubeconfig, "get", "pods", "-n", namespace, "-l", selector)["items"]
    ips = {
        p["metadata"]["name"]: p["status"].get("podIP", "")
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }
    before = _agent_states([ip for ip in ips.values() if ip], token)
    slices = _kubectl_json(
        kubeconfig, "get", "endpointslices", "-n", namespace,
        "-l", f"kubernetes.io/service-name={service}",
    )["items"]  # fmt: skip
    endpoints = {
        address: bool(e.get("conditions", {}).get("ready"))
        for s in slices
        for e in s.get("endpoints") or []
        for address in e["addresses"]
    }
    after = _agent_states([ip for ip in ips.values() if ip], token)
    return {
        "time": time.time(),
        "pods": ips,
        "agents_before": before,
        "endpoints": endpoints,
        "agents_after": after,
    }


class _Stop(BaseException):
    pass


def _on_term(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m weightroll_dev.realnode.sampler")
    p.add_argument("--kubeconfig", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--selector", required=True, help="label selector of the workload's pods")
    p.add_argument("--service", required=True)
    p.add_argument("--token-file", type=Path, required=True, help="the agents' bearer token")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    token = a.token_file.read_text().strip()
    signal.signal(signal.SIGTERM, _on_term)
    try:
        with a.out.open("a") as out:
            while True:
                try:
                    line = sample_once(a.kubeconfig, a.namespace, a.selector, a.service, token)
                except (subprocess.SubprocessError, ValueError) as e:
                    line = {"time": time.time(), "error": str(e)}
                out.write(json.dumps(line) + "\n")
                out.flush()
    except _Stop:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
