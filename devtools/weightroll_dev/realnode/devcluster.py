"""``weightroll_dev dev up --node real``: the chart, the operator and vLLM pods on the real node.

:func:`up` (on the host, as root):

1. the real node (:mod:`.node`) in ``DIR/node``, its own network namespace;
2. checkpoints ``v1`` (boot), ``v2``, ``v3`` with manifests in ``DIR/pv-models`` (the same tiny
   trained llamas as the stand-in dev cluster), mounted into the pods as a hostPath;
3. inside the namespace (``nsenter --net``, :func:`install`): the chart with its example
   workload at 0 replicas, the Deployment patched to run the checkout's Python
   (:mod:`.workload`) and scaled to ``--pods``; ``weightroll-operator`` as a host process
   (detached, PID in ``DIR/operator.pid``), authenticated as the chart's ServiceAccount; then
   it waits until the real scheduler placed every pod and the real kubelet reported it Ready
   (containers ready by their probes, readiness gate set True by the operator).

``DIR/cluster.json`` then says how to reach it (every client runs inside the namespace).
:func:`down` stops the operator, deletes the workload (so no ReplicaSet replaces the pods the
node's ``down`` deletes) and takes the node down, returning what it could not undo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weightroll_dev import checkout_pythonpath
from weightroll_dev.demo_view import condition
from weightroll_dev.devcluster.apiserver import OPERATOR_NAMESPACE, REPO
from weightroll_dev.devcluster.bringup import (
    BOOT,
    CLUSTER_JSON,
    MANIFEST,
    RELEASE,
    TOKEN,
    VERSIONS,
    _build_checkpoints,
)
from weightroll_dev.devcluster.operator_process import start_operator, wait_authorized
from weightroll_dev.devcluster.workload import SERVED_MODEL, TOKEN_SECRET, WORKLOAD
from weightroll_dev.realnode import node as realnode
from weightroll_dev.realnode.config import NodeLayout
from weightroll_dev.realnode.workload import host_python_patch, real_node_values

__all__ = ["install", "down", "up"]

OPERATOR_PID = "operator.pid"
CHART = REPO / "charts" / "weightroll"
SELECTOR = {"app.kubernetes.io/name": WORKLOAD}

Say = Callable[[str], None]


def _kubectl(kubeconfig: Path, *args: str, input_: str | None = None) -> str:
    """kubectl as admin from inside the namespace (:func:`install` runs there)."""
    proc = subprocess.run(
        ["kubectl", f"--kubeconfig={kubeconfig}", *args],
        input=input_,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if proc.returncode != 0:
        raise realnode.NodeError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def install(directory: Path, pods: int, timeout: float, say: Say) -> dict[str, Any]:
    """Steps 3 of the module docstring; runs inside the node's network namespace.

    Raises:
        NodeError: a step failed or the pods were not Ready within ``timeout`` seconds.
    """
    import helm_python

    layout = NodeLayout(directory / "node")
    run = layout.apiserver_run
    kubeconfig = run / "kubeconfig"
    pv = directory / "pv-models"
    values = real_node_values(BOOT, TOKEN, 0, pv)
    say("Installing the chart (CRD, operator RBAC, workload at 0 replicas)")
    config = helm_python.Config(kubeconfig_path=str(kubeconfig), namespace=OPERATOR_NAMESPACE)
    try:
        config.install(
            str(CHART), RELEASE, values, namespace=OPERATOR_NAMESPACE, create_namespace=True
        )
    finally:
        config.close()
    ns = ("-n", OPERATOR_NAMESPACE)
    deploy = json.loads(_kubectl(kubeconfig, "get", "deploy", WORKLOAD, *ns, "-o", "json"))
    patched = host_python_patch(deploy, Path(sys.prefix), REPO, checkout_pythonpath(), BOOT)
    patched["spec"]["replicas"] = pods
    _kubectl(kubeconfig, "replace", "-f", "-", input_=json.dumps(patched))

    say("Starting `weightroll-operator` (host process in the namespace) as its ServiceAccount")
    if not wait_authorized(kubeconfig, OPERATOR_NAMESPACE, "weightroll-operator"):
        raise realnode.NodeError("the chart's RBAC never let the operator patch pod status")
    try:
        running = start_operator(
            run / "kubeconfig-operator", directory / "operator.log", new_session=True
        )
    except RuntimeError as e:
        raise realnode.NodeError(str(e)) from None
    (directory / OPERATOR_PID).write_text(f"{running.process.pid}\n")

    say(f"Waiting for {pods} vLLM pods: real scheduler, kubelet probes, the operator's gate")
    deadline = time.monotonic() + timeout
    selector = ",".join(f"{k}={v}" for k, v in SELECTOR.items())
    shown = ""
    while True:
        items = json.loads(_kubectl(kubeconfig, "get", "pods", *ns, "-l", selector, "-o", "json"))[
            "items"
        ]
        rows = " ".join(
            f"{p['metadata']['name']}={p['status'].get('phase')}/"
            f"gate:{condition(p, 'weightroll.io/weights-ready')}/Ready:{condition(p, 'Ready')}"
            for p in items
        )
        if rows != shown:
            say(rows)
            shown = rows
        live = [p for p in items if not p["metadata"].get("deletionTimestamp")]
        if len(live) == pods and all(condition(p, "Ready") == "True" for p in live):
            break
        if running.process.poll() is not None or time.monotonic() > deadline:
            raise realnode.NodeError(f"pods not Ready (limit {timeout:.0f} s): {rows}")
        time.sleep(2)
    info = {
        "kubeconfig": str(kubeconfig),
        "netns": json.loads(layout.state_file.read_text())["netns"],
        "namespace": OPERATOR_NAMESPACE,
        "selector": SELECTOR,
        "tokenSecret": TOKEN_SECRET,
        "agentToken": TOKEN,
        "servedModel": SERVED_MODEL,
        "checkpoints": {
            v: {"uri": f"file:///models/{v}", "manifest": f"file:///models/{v}/{MANIFEST}"}
            for v in VERSIONS
        },
        "pods": {p["metadata"]["name"]: p["status"]["podIP"] for p in live},
        "operatorPid": running.process.pid,
        "operatorMetricsUrl": running.metrics_url,
        "operatorLog": str(directory / "operator.log"),
    }
    tmp = directory / f".{CLUSTER_JSON}.tmp"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, directory / CLUSTER_JSON)
    return info


def up(directory: Path, pods: int, say: Say = print, timeout: float = 900) -> dict[str, Any]:
    """Bring the real node, the chart, the operator and ``pods`` vLLM pods up (module
    docstring); returns ``cluster.json``'s content. On failure everything is taken down.

    Raises:
        NodeError: a step failed (the message says which; logs under ``directory``).
    """
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    node = realnode.up(directory / "node", say=say)
    try:
        say("Building checkpoints v1, v2, v3 with manifests (cached after once)")
        _build_checkpoints(directory / "pv-models", VERSIONS, seeds={})
        argv = [sys.executable, "-m", "weightroll_dev.realnode.devcluster", "install"]
        argv += [f"--dir={directory}", f"--pods={pods}", f"--timeout={timeout}"]
        env = {**os.environ, **realnode.NODE_ENV, "PYTHONPATH": checkout_pythonpath()}
        proc = subprocess.Popen(
            node.in_netns(*argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        for line in proc.stdout:
            say(line.rstrip())
        if proc.wait() != 0:
            raise realnode.NodeError(f"installing the workload failed (exit {proc.returncode})")
        return dict(json.loads((directory / CLUSTER_JSON).read_text()))
    except BaseException:
        for problem in down(directory):
            say(f"left behind: {problem}")
        raise


def _stop_operator(directory: Path) -> None:
    try:
        pid = int((directory / OPERATOR_PID).read_text())
    except (OSError, ValueError):
        return
    with contextlib.suppress(OSError):
        # Never signal a PID that was reused by something else.
        if b"weightroll-operator" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return
        os.kill(pid, signal.SIGTERM)
        for _ in range(60):
            Path(f"/proc/{pid}/cmdline").read_bytes()
            time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)


def down(directory: Path) -> list[str]:
    """Stop the operator, delete the workload, take the node down; returns what stayed."""
    directory = directory.resolve()
    _stop_operator(directory)
    layout = NodeLayout(directory / "node")
    if layout.state_file.exists():
        netns = json.loads(layout.state_file.read_text())["netns"]
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                realnode.in_netns(netns, [
                    "kubectl", f"--kubeconfig={layout.apiserver_run / 'kubeconfig'}", "delete",
                    "deploy", "--all", "-A", "--wait=false",
                ]),
                capture_output=True, check=False, timeout=30,
            )  # fmt: skip
    problems = realnode.down(layout.root)
    for name in (CLUSTER_JSON, OPERATOR_PID):
        with contextlib.suppress(FileNotFoundError):
            (directory / name).unlink()
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m weightroll_dev.realnode.devcluster install``: :func:`install`, run by
    :func:`up` inside the namespace."""
    p = argparse.ArgumentParser(prog="python -m weightroll_dev.realnode.devcluster")
    p.add_argument("action", choices=["install"])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--pods", type=int, required=True)
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args(argv)
    try:
        install(a.dir, a.pods, a.timeout, say=lambda s: print(s, flush=True))
    except realnode.NodeError as e:
        print(f"install: {e}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
