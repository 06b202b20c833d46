"""``weightroll_dev demo`` (``make demo``): a verified rollout through three vLLM pods, locally.

It runs on the dev cluster of ``weightroll_dev dev up`` (:mod:`weightroll_dev.devcluster.bringup`,
the same bring-up as the e2e tier), all on this machine and all stopped at the end (also on
Ctrl-C / SIGTERM): the local kube-apiserver + etcd (built once into the cache, after
``scripts/system-deps.sh`` when the toolchain is missing and we are root), the chart with its
example workload, ``weightroll-operator`` as the chart's ServiceAccount, and three pods run by
the kubelet stand-in, each a real vLLM CPU server plus the agent on its own loopback IP. The
checkpoints are tiny llamas trained on the spot (:mod:`weightroll_dev.demomodels`) to answer the
demo's prompt with one readable sentence per version.

Then it applies a WeightUpdate ``v1 -> v2`` and shows the rollout live (per pod: draining ->
loading -> verifying -> ready, with the version), asking each serving pod the same prompt as it
goes, so the output is seen to change exactly when that pod's update commits. ``--scenario
fail`` corrupts one pod's copy of v2: that pod stays drained and the rollout halts (or rolls back
with ``--on-failure Rollback``). On a TTY the view updates in place; otherwise (CI) one line per
change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from weightroll_operator.domain.model import (
    ANNOTATION_WEIGHT_STATE,
    CONDITION_WEIGHTS_READY,
    LABEL_WEIGHT_VERSION,
)
from weightroll_operator.k8s.client import KubeApi, KubeConfig

from weightroll_dev.demo_view import Asker, Console, condition, serving
from weightroll_dev.demomodels import PROMPT, answer
from weightroll_dev.devcluster.bringup import ClusterInfo, DevError, Options, down, up
from weightroll_dev.realnode.demo import DemoNode

__all__ = ["main"]

PODS = tuple(f"vllm-example-{i}" for i in range(3))
OLD, NEW = "v1", "v2"
UPDATE = "demo-to-v2"
#: Tokens asked per answer: each demo sentence and its end fit (a byte-level BPE of 512).
ANSWER_TOKENS = 48
#: Pod IPs start at 127.0.0.<this>.
DEMO_FIRST_IP = 100
ROLLOUT_TIMEOUT = 300
TERMINAL = ("Succeeded", "Failed", "RolledBack")
#: Stages of the live view in which a pod is mid-operation.
BUSY_STAGES = ("prefetch", "draining", "loading", "verifying", "committed", "restoring", "rolling")

#: Metrics shown at the end (name prefixes; zero-valued phase gauges are left out).
KEY_METRICS = (
    "weightroll_updates_total",
    "weightroll_update_phase",
    "weightroll_replicas",
    "weightroll_rollout_duration_seconds_sum",
    "weightroll_unit_update_duration_seconds_count",
    "weightroll_unit_update_duration_seconds_sum",
    "weightroll_verification_failures_total",
    "weightroll_replica_drained_since_timestamp_seconds",
)


class DemoError(DevError):
    """A step of the demo failed; the message says which and why."""


class _Stop(BaseException):
    """SIGTERM, handled like Ctrl-C."""


class ClusterDemo:
    """Everything the demo starts, and the steps; :meth:`close` stops all of it."""

    def __init__(
        self,
        work: Path,
        console: Console,
        scenario: str,
        on_failure: str,
        prefetch: str = "None",
        node: str = "stand-in",
    ) -> None:
        self.work = work
        #: ``real``: the cluster runs on the real node (:mod:`weightroll_dev.realnode.demo`).
        self.real = DemoNode(work / "dev") if node == "real" else None
        self.out = console
        self.scenario = scenario
        self.on_failure = on_failure
        #: strategy.prefetch.mode: ``Host`` stages and verifies v2 while each pod still serves.
        self.prefetch = prefetch
        #: The dev cluster (``weightroll_dev dev up``) the demo runs on, once it is up.
        self.info: ClusterInfo | None = None
        #: The demo's pods: named by the stand-in, by the ReplicaSet on the real node.
        self.names: tuple[str, ...] = PODS
        self.bad = PODS[1] if scenario == "fail" else None
        self.before: dict[str, str | None] = {}
        self.after: dict[str, str | None] = {}
        #: pod -> answers seen during the rollout: (version label at the time, text)
        self.seen: dict[str, list[tuple[str, str]]] = {p: [] for p in self.names}
        #: Most pods out of traffic at once during the rollout (maxUnavailable is 1).
        self.most_out = 0
        #: Reads for the live view go through the operator's own API client on one private loop
        #: (a kubectl process per read made the view miss short stages on a busy machine).
        self._loop = asyncio.new_event_loop()
        self._api: KubeApi | None = None

    # ------------------------------------------------------------------ helpers

    @property
    def cluster(self) -> ClusterInfo:
        assert self.info is not None, "bring_up() first"
        return self.info

    def _read(self, call: Callable[[KubeApi], Awaitable[Any]]) -> Any:
        """One API read on the demo's loop (main thread only), with the admin kubeconfig."""
        if self._api is None:
            self._api = KubeApi(KubeConfig.load(self.cluster.kubeconfig))
        return self._loop.run_until_complete(call(self._api))

    def pods(self) -> dict[str, dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in self.cluster.selector.items())
        items = self._read(lambda api: api.list_pods(self.cluster.namespace, selector))
        return {p["metadata"]["name"]: p for p in items}

    def weightupdate(self) -> dict[str, Any]:
        ns = self.cluster.namespace
        wu: dict[str, Any] = self._read(lambda api: api.get_weightupdate(ns, UPDATE))
        return wu

    def ip(self, pod: str) -> str:
        return self.cluster.host(pod)

    def _http(self, url: str, body: dict[str, Any] | None = None, timeout: float = 10) -> Any:
        data = None if body is None else json.dumps(body).encode()
        token = self.cluster.agentToken
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        req = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def ask(self, pod: str, timeout: float = 60) -> str:
        # 48 tokens from a vLLM that just booted, beside two others, on 2 loaded cores
        body = {
            "model": self.cluster.servedModel,
            "prompt": PROMPT,
            "max_tokens": ANSWER_TOKENS,
            "temperature": 0,
            "seed": 0,
        }
        out = self._http(f"{self.cluster.pods[pod]}/completions", body, timeout)
        return str(out["choices"][0]["text"])

    def agent_version(self, pod: str) -> str:
        """The version the pod's agent reports (before the first update the pod has no label)."""
        try:
            out = self._http(f"{self.cluster.agents[pod]}/v1/state", timeout=3)
        except (urllib.error.URLError, OSError, ValueError):
            return "?"
        return str(out.get("version") or "?")

    def agent_phase(self, pod: str, update_id: str) -> str | None:
        try:
            url = f"{self.cluster.agents[pod]}/v1/updates/{update_id}"
            out = self._http(url, timeout=3)
        except (urllib.error.URLError, OSError, ValueError):
            return None
        phase = out.get("phase")
        return str(phase) if phase else None

    # ------------------------------------------------------------------ steps

    def bring_up(self) -> None:
        """``weightroll_dev dev up --pods 3`` in the work directory (pod IPs 127.0.0.100 and up,
        away from the e2e tier's, so a concurrent test fleet never answers for a demo pod); with
        ``--node real``, ``dev up --node real --pods 3`` and the demo inside its namespace."""
        say = self.out.line
        if self.real is None:
            self.out.step(
                "Dev cluster (weightroll_dev dev up): kube-apiserver, chart, operator, 3 vLLM pods",
                "checkpoints v1, v2, v3 are tiny llamas trained to answer the prompt (cached)",
            )
            self.info = up(Options(self.work / "dev", pods=len(PODS), first_ip=DEMO_FIRST_IP), say)
            kubectl = "kubectl"
        else:
            self.out.step(
                "Dev cluster on the real node (weightroll_dev dev up --node real): kubelet, "
                "containerd, controllers, chart, operator, 3 vLLM pods",
                "checkpoints v1, v2, v3 are tiny llamas trained to answer the prompt (cached)",
            )
            self.info = self.real.up(len(PODS), say)
            self.names = tuple(sorted(self.info.pods))
            self.seen = {p: [] for p in self.names}
            kubectl = f"nsenter --net=/run/netns/{self.real.netns} -- kubectl"
        self.out.line(f"cluster up: {Path(self.cluster.dir) / 'cluster.json'}")
        self.out.line(
            f"{kubectl} --kubeconfig {self.cluster.kubeconfig} get pods -n {self.cluster.namespace}"
        )
        for version in (OLD, NEW):
            self.out.line(f"{version} is trained to answer {PROMPT!r} with {answer(version)!r}")

    def operator_log(self) -> str:
        return self.cluster.operator_log_tail(30)

    def ask_all(self, label: str) -> dict[str, str | None]:
        self.out.step(f"Same prompt to every pod ({label})", repr(PROMPT))
        out: dict[str, str | None] = {}
        pods = self.pods()
        for pod in self.names:
            if not serving(pods[pod]):
                out[pod] = None
                self.out.line(f"{pod:<16} is drained (out of traffic): not asked")
                continue
            out[pod] = self.ask(pod)
            version = self._version(pod)
            self.out.line(f"{pod:<16} {self.ip(pod)}:8000 @ {version}: {out[pod]!r}")
        return out

    def corrupt(self) -> None:
        assert self.bad is not None
        target = self.cluster.corrupt(self.bad, NEW)
        self.out.step(
            f"Scenario fail: corrupting {self.bad}'s node-local copy of {NEW}",
            f"one byte of {target.name} flipped; its manifest digest no longer matches",
        )

    def apply_update(self) -> None:
        self.out.step(
            f"Applying WeightUpdate {UPDATE}: {OLD} -> {NEW}",
            f"maxUnavailable 1, onFailure {self.on_failure}, prefetch {self.prefetch}",
        )
        self.cluster.apply(
            self.cluster.weightupdate(
                UPDATE, NEW, on_failure=self.on_failure, prefetch={"mode": self.prefetch}
            )
        )

    def _stage(self, name: str, pod: dict[str, Any]) -> tuple[str, str]:
        """(stage, version) of one pod, from its weight-state annotation, conditions, agent."""
        meta = pod.get("metadata", {})
        version = (meta.get("labels") or {}).get(LABEL_WEIGHT_VERSION) or self.agent_version(name)
        ready = serving(pod)
        raw = (meta.get("annotations") or {}).get(ANNOTATION_WEIGHT_STATE)
        ws: dict[str, Any] = json.loads(raw) if raw else {}
        state = ws.get("state")
        if state == "Prefetching":  # still in traffic: the agent reads v2 into host staging
            staged = self.agent_phase(name, str(ws.get("updateId"))) == "Prefetched"
            return ("prefetched, serving" if staged else "prefetching, serving"), version
        if state == "Draining":
            phase = self.agent_phase(name, str(ws.get("updateId")))
            stage = {"Loading": "loading", "Verifying": "verifying", "Committed": "committed"}
            before = ws.get("previousVersion") or version
            return stage.get(phase or "", "draining"), f"{before} -> {ws.get('version')}"
        if state == "Failed":
            reason = str(ws.get("reason") or "")[:140]
            return "FAILED, stays drained", f"{version} ({reason})"
        if state == "RollingBack":
            return "rolling back", f"{ws.get('rollbackOf')} -> {ws.get('version')}"
        if state in ("Verified", "RolledBack"):
            done = "ready" if state == "Verified" else "rolled back"
            return (done if ready else "restoring traffic"), version
        return ("ready" if ready else "not ready"), version

    def watch_rollout(self) -> dict[str, Any]:
        """The live view until the WeightUpdate is terminal, polling every 0.5 s; meanwhile an
        :class:`~weightroll_dev.demo_view.Asker` asks the serving pods (slow answers never
        hide a stage)."""
        stages = "draining -> loading -> verifying -> ready"
        if self.prefetch == "Host":
            stages = f"prefetching, serving -> prefetched, serving -> {stages}"
        self.out.step(f"Rollout (per pod: {stages})")
        deadline = time.monotonic() + ROLLOUT_TIMEOUT
        status: dict[str, Any] = {}
        settle: float | None = None  # once terminal: until no pod is mid-operation (<= 15 s)
        asker = Asker(self.names, self.ask, self.pods, default_version=OLD)
        try:
            while True:
                read_at = time.monotonic()
                # The WeightUpdate first: once it is terminal, the pods read after it are final.
                status = self.weightupdate().get("status") or {}
                pods = self.pods()
                asker.observe(read_at, pods)
                for name, label, text in asker.take():
                    self._record(name, label, text)
                rows = {}
                for name in self.names:
                    stage, version = self._stage(name, pods[name])
                    rows[name] = f"{stage:<22} {version}"
                self.most_out = max(
                    self.most_out, sum(1 for n in self.names if not serving(pods[n]))
                )
                counts = status.get("replicas") or {}
                header = (
                    f"WeightUpdate {UPDATE}: phase {status.get('phase', 'Pending')}, "
                    f"updated {counts.get('updated', 0)}/{len(self.names)}"
                )
                self.out.view(rows, header)
                if status.get("phase") in TERMINAL:  # read before the pods: rows are final
                    settle = settle or time.monotonic() + 15
                    busy = BUSY_STAGES
                    if time.monotonic() > settle or not any(
                        r.startswith(busy) for r in rows.values()
                    ):
                        break
                if not self.cluster.operator_alive():
                    raise DemoError(f"the operator exited: {self.operator_log()}")
                if time.monotonic() > deadline:
                    raise DemoError(f"rollout not finished after {ROLLOUT_TIMEOUT}s: {status}")
                time.sleep(0.5)
        except BaseException:
            asker.stop(timeout=0)  # Ctrl-C or a failure: no more questions, no waiting
            raise
        asker.stop()
        for name, label, text in asker.take():
            self._record(name, label, text)
        self.out.done_view()
        self.out.line(f"WeightUpdate {UPDATE} is {status.get('phase')}")
        self.out.line(f"pods out of traffic at once: at most {self.most_out} (maxUnavailable 1)")
        return status

    def _record(self, pod: str, version: str, text: str) -> None:
        seen = self.seen[pod]
        if not seen or seen[-1][1] != text:
            self.out.line(f"{pod:<16} now answers {text!r} (weights {version})")
        seen.append((version, text))

    def check_outputs(self) -> bool:
        """Every answer seen at v1 is the v1 sentence, every one at v2 the v2 sentence (what
        each version was trained to say, :mod:`weightroll_dev.demomodels`)."""
        self.out.step("Outputs against commits")
        ok = True
        for pod in self.names:
            after = self.after.get(pod)
            at = self._version(pod)
            answers = [
                (OLD, self.before[pod]),
                *self.seen[pod],
                *([] if after is None else [(at, after)]),
            ]
            wrong = [(v, t) for v, t in answers if v in (OLD, NEW) and t != answer(v)]
            changed = after is not None and after != self.before[pod]
            if wrong:
                ok = False
                verdict = f"MISMATCH: answers not matching their version: {wrong[:3]}"
            elif after is None:
                verdict = f"drained, never served {NEW} (its update did not commit)"
            elif changed:
                verdict = f"changed at its commit ({OLD} -> {at}), never before"
            elif any(v == NEW for v, _ in self.seen[pod]):
                verdict = f"served {NEW} from its commit, {at} again from its rollback"
            else:
                verdict = f"unchanged: still serving {at}"
            self.out.line(f"{pod:<16} {len(answers)} answers; {verdict}")
        self.out.line(f"outputs changed only at commit: {'yes' if ok else 'NO'}")
        return ok

    def _version(self, pod: str) -> str:
        label = self.pods()[pod]["metadata"].get("labels", {}).get(LABEL_WEIGHT_VERSION)
        return str(label) if label else self.agent_version(pod)

    def explain_failure(self) -> None:
        pods = self.pods()
        for name in self.names:
            pod = pods[name]
            raw = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_WEIGHT_STATE)
            ws = json.loads(raw) if raw else {}
            if ws.get("state") == "Failed":
                self.out.line(
                    f"{name} stays drained: {CONDITION_WEIGHTS_READY}="
                    f"{condition(pod, CONDITION_WEIGHTS_READY)}, "
                    f"Ready={condition(pod, 'Ready')}; why: {ws.get('reason')}"
                )

    def final_status(self) -> None:
        from weightroll_operator import status_view

        self.out.step("Final status (weightroll status)")
        ns, kubeconfig = self.cluster.namespace, self.cluster.kubeconfig
        status_view.main([UPDATE, "-n", ns, f"--kubeconfig={kubeconfig}"])
        self.out.step("Key operator metrics", self.cluster.operatorMetricsUrl)
        with urllib.request.urlopen(self.cluster.operatorMetricsUrl, timeout=10) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith(KEY_METRICS) and not (
                line.startswith("weightroll_update_phase") and line.endswith(" 0.0")
            ):
                print(f"    {line}", flush=True)

    # ------------------------------------------------------------------ the script

    def run(self) -> int:
        self.bring_up()
        self.before = self.ask_all(f"before the update, all on {OLD}")
        if self.bad:
            self.corrupt()
        self.apply_update()
        status = self.watch_rollout()
        self.after = self.ask_all("after the rollout")
        ok = self.check_outputs()
        if self.scenario == "fail":
            self.explain_failure()
        self.final_status()
        want = (
            "Succeeded"
            if self.scenario == "ok"
            else ("RolledBack" if self.on_failure == "Rollback" else "Failed")
        )
        phase = status.get("phase")
        if phase != want:
            self.out.step(f"Unexpected: WeightUpdate is {phase}, expected {want}")
            return 1
        return 0 if ok else 1

    def close(self) -> None:
        """Stop everything started, newest first; each step runs even if another fails."""
        self.out.step(
            "Shutting down (weightroll_dev dev down): operator, pods, kube-apiserver, etcd"
        )
        if self._api is not None:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._api.close())
        self._loop.close()
        if self.real is not None:
            self.real.down(self.out.line)
        else:
            down(self.work / "dev", say=self.out.line)
        self.out.line("everything started by the demo is stopped")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m weightroll_dev demo",
        description="Roll new weights through three real vLLM CPU pods on a local kube-apiserver "
        "with the operator, live (make demo). Builds the kube-apiserver once when it is not "
        "cached (installing go and etcd first when run as root).",
    )
    p.add_argument(
        "--engine",
        action="store_true",
        help="run the single-engine demo instead (no cluster: one vLLM engine, a verified "
        "update, a half-sent update refused; `python -m weightroll_dev demo --engine --help`)",
    )
    p.add_argument(
        "--scenario",
        choices=("ok", "fail"),
        default="ok",
        help="ok: every pod moves to v2; fail: one pod's checkpoint copy is corrupt (default ok)",
    )
    p.add_argument(
        "--on-failure",
        choices=("Halt", "Rollback"),
        default="Halt",
        help="strategy.onFailure of the WeightUpdate (default Halt)",
    )
    p.add_argument(
        "--prefetch",
        choices=("None", "Host"),
        default="None",
        help="strategy.prefetch.mode of the WeightUpdate: Host reads and verifies v2 into host "
        "memory while each pod still serves, so a pod is out of traffic only for the swap "
        "(default None)",
    )
    p.add_argument(
        "--node",
        choices=("stand-in", "real"),
        default="stand-in",
        help="real: the same rollout on a real kubelet, containerd and controllers in a network "
        "namespace (root; docs/real-node.md); default: the kubelet stand-in",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        help="where models, pod roots and logs go (default: a temp dir, removed at the end)",
    )
    return p


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.engine:  # routed to demo_engine by weightroll_dev.__main__ before this module
        print(
            "weightroll_dev demo: run the single-engine demo as `python -m weightroll_dev demo "
            "--engine` (make demo-engine)",
            file=sys.stderr,
        )
        return 2
    if args.node == "real" and args.scenario == "fail":
        print(
            "weightroll_dev demo: --scenario fail corrupts one pod's own checkpoint copy; the "
            "real node's pods share one volume (run it without --node real)",
            file=sys.stderr,
        )
        return 2
    if importlib.util.find_spec("vllm") is None:
        print(
            "weightroll_dev demo: vLLM is not installed; run `make demo` (it installs it)",
            file=sys.stderr,
        )
        return 2
    if args.scenario == "ok" and args.on_failure != "Halt":
        print("    (--on-failure matters only with --scenario fail)", flush=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="weightroll-demo-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    console = Console(tty=sys.stdout.isatty())
    demo = ClusterDemo(
        work.resolve(), console, args.scenario, args.on_failure, args.prefetch, args.node
    )
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # Ctrl-C always stops the demo cleanly, even when started with SIGINT ignored (`cmd &`).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = 1
    try:
        code = demo.run()
    except (KeyboardInterrupt, _Stop):
        console.step("Interrupted: cleaning up")
        code = 130
    except DevError as e:  # DemoError included
        console.step(f"Demo failed: {e}")
        code = 1
    except Exception as e:  # any other failure: one line, then the same clean shutdown
        console.step(f"Demo failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        # A second Ctrl-C must not leave processes behind: cleanup ignores it.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            demo.close()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, previous)
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    console.step(
        "Done" if code == 0 else f"Done (exit {code})", f"{time.monotonic() - console.began:.0f}s"
    )
    return code


if __name__ == "__main__":
    raise SystemExit(main())
