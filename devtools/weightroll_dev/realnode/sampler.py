"""Sample a Service's EndpointSlices and the agents behind them, inside the node's namespace.

The verdict of a rollout on the real node is read from what traffic follows: the Service's
EndpointSlices, written by the real controller-manager from the Ready conditions the real
kubelet reports. ``python -m weightroll_dev.realnode.sampler`` runs inside the node's network
namespace (pod IPs are reachable only there) and appends one JSON line per round to ``--out``
until SIGTERM:

``{"pods": {name: ip}, "agents_before": {ip: state}, "endpoints": {ip: ready},
"agents_after": {ip: state}}``

Each round reads every selected pod's agent ``GET /v1/state``, then the EndpointSlices, then
the agents again: an endpoint counts against an agent only when *both* reads around the slice
say the pod was not serving an accepted version (:func:`violations`), so a pod that finished
its update between two reads is never blamed for the slice's lag.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["budget_breaches", "serving_accepted", "violations"]


def serving_accepted(state: Mapping[str, Any] | None, accepted: Collection[str]) -> bool:
    """Whether an agent's ``/v1/state`` (wire names, camelCase) says its pod serves one of
    ``accepted``, ready and not inside an update (``None``: the agent did not answer)."""
    return bool(
        state
        and state.get("ready") is True
        and state.get("version") in accepted
        and not state.get("activeUpdateId")
    )


def violations(sample: Mapping[str, Any], accepted: Collection[str]) -> list[str]:
    """Ready endpoints whose agent, read before and after the slice, served no accepted version."""
    found = []
    for ip, ready in sample["endpoints"].items():
        before = sample["agents_before"].get(ip)
        after = sample["agents_after"].get(ip)
        if (
            ready
            and not serving_accepted(before, accepted)
            and not serving_accepted(after, accepted)
        ):
            found.append(f"{ip} is a ready endpoint; agent said {before} then {after}")
    return found


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
    before = {ip: _agent_state(ip, token) for ip in ips.values() if ip}
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
    after = {ip: _agent_state(ip, token) for ip in ips.values() if ip}
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
