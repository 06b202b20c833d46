"""The ``dev up --node real`` cluster as the real-node tests drive it, and the EndpointSlice
sampler running beside a scenario.

:class:`RealFleet` wraps the ``cluster.json`` of :func:`weightroll_dev.realnode.devcluster.up`:
kubectl and ``ctr`` against the node (every client inside the node's network namespace), the
workload's pods, and the one WeightUpdate a scenario steers. :class:`Sampling` runs
:mod:`weightroll_dev.realnode.sampler` for the length of a ``with`` block and gives its rounds
to the verdicts (:func:`~weightroll_dev.realnode.sampler.judge`,
:func:`~weightroll_dev.realnode.sampler.budget_breaches`).

Limitations: one real node per host (the tests share one cluster per session); the rounds are
read from the sampler's file, so a round being written is skipped until it is complete.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from weightroll_dev import checkout_pythonpath
from weightroll_dev.realnode import missing_prerequisites
from weightroll_dev.realnode.config import NodeLayout
from weightroll_dev.realnode.node import in_netns

from tests.harness.polling import poll

GATE = "weightroll.io/weights-ready"
SERVICE = "vllm-example"
WEIGHTUPDATE = "weightupdates.weightroll.io"
TERMINAL_BAD = ("Failed", "Halted", "RolledBack")


def realnode_marks() -> list[pytest.MarkDecorator]:
    """A module's marks: ``realnode``, skipped with the missing pieces named (root, the node's
    binaries and packages, vLLM)."""
    missing = missing_prerequisites()
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM in the virtualenv")
    reason = "real node needs: " + "; ".join(missing)
    return [pytest.mark.realnode, pytest.mark.skipif(bool(missing), reason=reason)]


def condition(pod: dict[str, Any], kind: str) -> str | None:
    found = [c["status"] for c in pod["status"].get("conditions", []) if c["type"] == kind]
    return found[0] if found else None


@dataclass
class RealFleet:
    """A running ``dev up --node real`` cluster (``info`` is its ``cluster.json``)."""

    directory: Path
    info: dict[str, Any]

    @property
    def namespace(self) -> str:
        return str(self.info["namespace"])

    @property
    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.info["selector"].items())

    def kubectl(self, *args: str, input_: str | None = None) -> str:
        """kubectl as admin inside the namespace; a failure fails the test with stderr."""
        argv = ["kubectl", f"--kubeconfig={self.info['kubeconfig']}", *args]
        proc = subprocess.run(
            in_netns(self.info["netns"], argv),
            input=input_, capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, f"kubectl {args}: {proc.stderr}"
        return proc.stdout

    def ctr(self, *args: str) -> str:
        """``ctr`` against the node's containerd (namespace ``k8s.io``)."""
        socket = NodeLayout(self.directory / "node").containerd_socket
        proc = subprocess.run(
            ["ctr", "--address", str(socket), "-n", "k8s.io", *args],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, f"ctr {args}: {proc.stderr}"
        return proc.stdout

    def pods(self) -> dict[str, dict[str, Any]]:
        """The workload's pods not being deleted, by name."""
        out = self.kubectl("get", "pods", "-n", self.namespace, "-l", self.selector, "-o", "json")
        items = json.loads(out)["items"]
        return {
            p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")
        }

    def container_id(self, pod: str, container: str) -> str:
        """The containerd id of a running container of ``pod``."""
        body = json.loads(self.kubectl("get", "pod", pod, "-n", self.namespace, "-o", "json"))
        (status,) = [s for s in body["status"]["containerStatuses"] if s["name"] == container]
        return str(status["containerID"].split("://", 1)[1])

    def ensure_service(self) -> None:
        """A Service over the workload: its EndpointSlices are what traffic follows."""
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": SERVICE, "namespace": self.namespace},
            "spec": {
                "selector": self.info["selector"],
                "ports": [{"port": 8000, "targetPort": 8000}],
            },
        }
        self.kubectl("apply", "-f", "-", input_=json.dumps(service))

    def apply_weightupdate(self, name: str, version: str) -> None:
        """Create or retarget WeightUpdate ``name`` (``maxUnavailable: 1``, ``Halt``)."""
        update = {
            "apiVersion": "weightroll.io/v1alpha1",
            "kind": "WeightUpdate",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {
                "selector": {"matchLabels": self.info["selector"]},
                "version": version,
                "source": dict(self.info["checkpoints"][version]),
                "strategy": {
                    "maxUnavailable": 1,
                    "onFailure": "Halt",
                    "updateTimeoutSeconds": 300,
                    "drain": {"mode": "wait", "timeoutSeconds": 10},
                },
                "agent": {"tokenSecretRef": {"name": self.info["tokenSecret"]}},
            },
        }
        self.kubectl("apply", "-f", "-", input_=json.dumps(update))

    def weightupdate(self, name: str) -> dict[str, Any]:
        out = self.kubectl("get", WEIGHTUPDATE, name, "-n", self.namespace, "-o", "json")
        return dict(json.loads(out))

    def wait_succeeded(
        self, name: str, version: str, sampler: Sampling | None = None, timeout: float = 600
    ) -> None:
        """Until WeightUpdate ``name`` is ``Succeeded`` at ``version``; a halt fails at once, and
        so does what the ``sampler``'s guard finds meanwhile."""

        def done() -> bool:
            if sampler is not None:
                sampler.check()
            body = self.weightupdate(name)
            phase = body.get("status", {}).get("phase", "")
            assert phase not in TERMINAL_BAD, json.dumps(body.get("status"), indent=1)
            observed = body.get("status", {}).get("observedGeneration")
            current = observed == body["metadata"]["generation"]
            return bool(phase == "Succeeded" and current and body["spec"]["version"] == version)

        def status() -> str:
            return json.dumps(self.weightupdate(name).get("status"), indent=1)

        poll(f"WeightUpdate {name} Succeeded at {version}", done, timeout, 1, status)

    def sampling(self, out: Path) -> Sampling:
        token = out.with_suffix(".token")
        token.write_text(self.info["agentToken"])
        argv = [sys.executable, "-m", "weightroll_dev.realnode.sampler",
                f"--kubeconfig={self.info['kubeconfig']}", f"--namespace={self.namespace}",
                f"--selector={self.selector}", f"--service={SERVICE}", f"--token-file={token}",
                f"--out={out}"]  # fmt: skip
        return Sampling(in_netns(self.info["netns"], argv), out)


@dataclass
class Sampling:
    """The sampler process for the length of a ``with`` block, and its rounds."""

    argv: list[str]
    out: Path
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    #: Judges the rounds so far; what it returns fails the next wait at once, so a broken gate
    #: fails on the slice it shows in, not later on a rollout that stalls because of it.
    guard: Callable[[list[dict[str, Any]]], list[str]] | None = field(default=None, init=False)

    def __enter__(self) -> Sampling:
        env = {**os.environ, "PYTHONPATH": checkout_pythonpath()}
        self.process = subprocess.Popen(self.argv, env=env)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)

    def rounds(self) -> list[dict[str, Any]]:
        """Every complete round without an error, oldest first."""
        if not self.out.exists():
            return []
        found = []
        for line in self.out.read_text().splitlines():
            try:
                round_ = json.loads(line)
            except ValueError:
                continue  # the line being written
            if "error" not in round_:
                found.append(round_)
        return found

    def wait(
        self, what: str, check: Callable[[dict[str, Any]], bool], timeout: float = 120
    ) -> dict[str, Any]:
        """Until a round begun after the call satisfies ``check``; returns the first such round
        (an event as short as one round is not missed between two polls)."""
        began = time.time()

        def first() -> dict[str, Any] | None:
            assert self.process is not None and self.process.poll() is None, "sampler exited"
            self.check()
            return next((r for r in self.since(began) if check(r)), None)

        return poll(what, first, timeout, interval=0.2)

    def check(self) -> None:
        """Fail now if :attr:`guard` finds a problem in the rounds so far."""
        if self.guard is not None:
            problems = self.guard(self.rounds())
            assert not problems, problems[:5]

    def since(self, began: float) -> list[dict[str, Any]]:
        """The rounds begun after ``began`` (``time.time()``)."""
        return [r for r in self.rounds() if r["time"] > began]


def ready_at(count: int, version: str | None = None) -> Callable[[dict[str, Any]], bool]:
    """A round check: ``count`` pods are ready endpoints (each serving ``version`` if given)."""

    def check(round_: dict[str, Any]) -> bool:
        ready = [ip for ip, ok in round_["endpoints"].items() if ok]
        if len(ready) != count or sorted(ready) != sorted(round_["pods"].values()):
            return False
        states = [round_["agents_after"].get(ip) or {} for ip in ready]
        return version is None or all(s.get("version") == version for s in states)

    return check


def serving_versions(round_: dict[str, Any]) -> set[str]:
    """The versions the agents of a round report."""
    return {str((s or {}).get("version")) for s in round_["agents_after"].values()}


def iter_out_of_endpoints(rounds: list[dict[str, Any]], pod: str) -> Iterator[dict[str, Any]]:
    """The rounds in which ``pod`` was selected but not a ready endpoint."""
    for round_ in rounds:
        ip = round_["pods"].get(pod)
        if ip and not round_["endpoints"].get(ip):
            yield round_
