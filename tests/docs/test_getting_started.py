"""docs/getting-started.md, run: every command on the page, in order, against the dev cluster.

The commands are read from the page itself, so the page and this test cannot drift. Each fenced
block on the page is preceded by one directive, an HTML comment the rendered page hides:

* ``<!-- run: STEP -->`` before a ``bash`` block: the block runs as one ``bash -e -o pipefail``
  script and must exit 0; ``<!-- run: STEP exit=N -->``: it must exit N (``weightroll status``
  exits 3 on a Failed rollout). STEP names the step for the checks below; the page's steps must
  be exactly :data:`STEPS`, in that order, so a new block needs a decision here.
* ``<!-- file: NAME -->`` before a ``yaml`` block: the block is written to NAME in the working
  directory (the reader saves it as ``update.yaml``), for the commands after it.

A fenced block without a directive fails the test: nothing on the page goes unrun.

The environment, made explicit (everything else runs as written):

* **Cluster**: ``weightroll_dev dev up --pods 2 --inject`` (the e2e tier's ``injected``
  fixture): the real kube-apiserver, the chart installed as release ``weightroll`` in
  ``weightroll-system`` with its example workload carrying only the inject label, the operator
  as the chart's ServiceAccount serving the webhooks, two real vLLM CPU pods with their agents.
  ``KUBECONFIG`` names its admin kubeconfig, for ``kubectl``, ``helm`` and ``weightroll``.
* **helm**: there is no ``helm`` binary here, and the dev cluster installs the chart itself before
  its simulated pods start. ``helm`` on the page's ``PATH`` is :mod:`tests.harness.helm_cli`: the
  page's ``helm install`` (its release, chart, namespace and ``--set`` values) runs through
  helm-python-sdk as a *server dry run* against the dev cluster (rendered with ``lookup``, every
  object mapped to a resource the API server serves, ownership of cluster-scoped objects checked,
  nothing created), and the test checks that the release it names is the one deployed there.
  That release carries the dev cluster's values, not the page's images: tiny models booting
  ``/models/v1``, the operator as a local process without agent TLS
  (``weightroll_dev.devcluster.workload.workload_values``).
  The Prometheus Operator's two CRDs the page's values need (ServiceMonitor, PrometheusRule) are
  created first with open schemas (the dev cluster has no Prometheus Operator).
* **Paths**: commands run in a scratch directory where ``charts`` links to this checkout's
  ``charts/``; a ``/models/...`` argument (the checkpoint volume as a reader's machine mounts it)
  becomes the dev cluster's persistent volume (``cluster.json`` ``persistentVolume``), which the
  pods mount at ``/models``. ``file:///models/...`` inside the WeightUpdates is the pods' path
  and stays.
* **The failure** is the environment's, not a command: before ``failed-rollout`` one pod's
  node-local copy of ``v3`` gets one flipped byte of tensor data (after ``manifest-v3`` hashed
  the good copy); before ``retry`` that copy is repaired (the corrupt file removed, the dev
  cluster links the shared one back in).
* **The alert**: a real Prometheus (:mod:`tests.harness.prometheus`) scrapes the operator as the
  chart's ServiceMonitor would and evaluates the chart's alert rules rendered with the page's
  own ``--set`` values, with the test-only overrides of ``tests/charts/helpers.FAST_RULES``
  (every ``for`` 2 s, the drained threshold 5 s; the expressions are the shipped ones).
  WeightrollUpdateFailed and WeightrollReplicaLeftDrained must fire after ``failed-rollout``,
  with ``runbook_url`` at the runbook the page links, and resolve after ``retry``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from weightroll_dev import checkout_pythonpath

from tests.charts.helpers import FAST_RULES, find, objects, render, rule_groups
from tests.e2e.conftest import GATE, INJECTED_PODS, NAMESPACE, Fleet
from tests.e2e.shared_fleet import repair_copy
from tests.harness.helm_cli import set_values
from tests.harness.prometheus import Prometheus, Target, prometheus_binary

pytestmark = [pytest.mark.cluster, pytest.mark.server, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
#: The page's run steps, in order (see the module docstring).
STEPS = (
    "install",
    "pods",
    "manifest",
    "first-rollout",
    "manifest-v3",
    "failed-rollout",
    "failed-status",
    "retry",
)
#: The pod whose copy of v3 is corrupt. The second: pods are taken in name order, so the first is
#: verified at v3 before the rollout halts (the checks below hold in either order).
BAD = INJECTED_PODS[1]
RELEASE = "weightroll"
#: Seconds from a phase change to a firing (or resolved) alert: scrape + evaluation + ``for``.
ALERT_SLACK = 60
#: A block's bound: the page's ``--watch --timeout 600`` plus the commands around it.
BLOCK_TIMEOUT = 720

_DIRECTIVE = re.compile(
    r"^<!-- (run|file): ([\w.-]+)((?: [\w-]+=\S+)*) -->\n```(\w+)\n(.*?)^```", re.M | re.S
)
_OPENING = re.compile(r"^```\w+\n", re.M)


@dataclass(frozen=True)
class Block:
    """One fenced block of the page and its directive."""

    kind: str  # "run" or "file"
    name: str  # the step, or the file name
    language: str
    body: str
    exit: int = 0


def page_blocks(text: str) -> list[Block]:
    """The page's blocks in order; every fenced block must carry a directive.

    Raises:
        AssertionError: a fenced block has no directive, or a directive the wrong language.
    """
    blocks = []
    for match in _DIRECTIVE.finditer(text):
        kind, name, options, language, body = match.groups()
        opts = dict(o.split("=", 1) for o in options.split())
        want = "bash" if kind == "run" else "yaml"
        assert language == want, f"<!-- {kind}: {name} --> precedes a {language} block"
        blocks.append(Block(kind, name, language, body, int(opts.pop("exit", "0"))))
        assert not opts, f"<!-- {kind}: {name} -->: unknown options {opts}"
    # an opening fence has an info string, a closing one none: count the openings
    openings = len(_OPENING.findall(text))
    assert openings == len(blocks), (
        f"{openings} fenced blocks, {len(blocks)} with a directive: every block of the page is "
        "either run or written by this test"
    )
    return blocks


def localise(script: str, volume: str) -> str:
    """``/models/...`` arguments -> the dev cluster's volume (``file:///models`` stays)."""
    return re.sub(r"(?<=\s)/models/", f"{volume}/", script)


_MONITORING_CRDS = [
    {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }
    for plural, kind in (
        ("servicemonitors", "ServiceMonitor"),
        ("prometheusrules", "PrometheusRule"),
    )
]


class PageRun:
    """Runs the page's blocks in a scratch directory against the dev cluster."""

    def __init__(self, fleet: Fleet, workdir: Path) -> None:
        self.fleet = fleet
        self.workdir = workdir
        (workdir / "charts").symlink_to(ROOT / "charts")
        bin_dir = workdir / ".bin"
        bin_dir.mkdir()
        helm = bin_dir / "helm"
        helm.write_text(
            f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m tests.harness.helm_cli "$@"\n'
        )
        helm.chmod(0o755)
        self.env = {
            **os.environ,
            "KUBECONFIG": fleet.info.kubeconfig,
            "PYTHONPATH": checkout_pythonpath(),
            # the stand-in helm, then this interpreter's scripts (`weightroll`), then the rest
            "PATH": os.pathsep.join(
                [str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]]
            ),
        }
        self.transcript: list[str] = []

    def run(self, block: Block) -> str:
        script = localise(block.body, self.fleet.info.persistentVolume)
        proc = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-x", "-c", script],
            cwd=self.workdir,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
            check=False,
        )
        out = proc.stdout + proc.stderr
        self.transcript.append(f"--- {block.name} (exit {proc.returncode})\n{out}")
        assert proc.returncode == block.exit, (
            f"step {block.name}: exit {proc.returncode}, the page says {block.exit}\n"
            + "\n".join(self.transcript[-3:])
            + f"\n{self.fleet.logs()}"
        )
        return proc.stdout


@pytest.fixture(scope="module")
def page() -> list[Block]:
    return page_blocks(PAGE.read_text())


@pytest.fixture(scope="module")
def page_values(page: list[Block]) -> dict[str, Any]:
    """The ``--set`` values of the page's ``helm install``."""
    (install,) = [b for b in page if b.name == "install"]
    argv = shlex.split(install.body.replace("\\\n", " "))
    return set_values([argv[i + 1] for i, a in enumerate(argv) if a == "--set"])


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@pytest.fixture(scope="module")
def prom(
    injected: Fleet, page_values: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    """Prometheus scraping the operator as the page's ServiceMonitor would, with its rules."""
    if prometheus_binary() is None:
        pytest.skip("prometheus is not installed: run `bash scripts/system-deps.sh`")
    values = _merge(page_values, FAST_RULES)
    monitor = find(objects(render(values)), "ServiceMonitor")
    operator = urlparse(injected.info.operatorMetricsUrl)
    target = Target(
        job="weightroll-metrics",
        address=operator.netloc,
        labels={"namespace": NAMESPACE},
        path=operator.path or "/metrics",
        honor_labels=bool(monitor["spec"]["endpoints"][0]["honorLabels"]),
    )
    with Prometheus(tmp_path_factory.mktemp("prometheus"), [target], rule_groups(values)) as server:
        server.wait(
            "the operator scraped", lambda: list(server.targets_up().values()) == ["up"], 60
        )
        yield server


def _firing(prom: Prometheus, alert: str, **labels: str) -> list[dict[str, Any]]:
    """Active firing alerts named ``alert`` whose labels include ``labels`` (with annotations)."""
    return [
        a
        for a in prom.api("alerts")["alerts"]
        if a["labels"].get("alertname") == alert
        and a["state"] == "firing"
        and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def _repair(fleet: Fleet, pod: str, version: str) -> None:
    """Give ``pod`` back the shared copy of ``version`` (its own is corrupt)."""
    repaired = repair_copy(fleet, pod, version)
    assert repaired, f"{pod}'s copy of {version} is not corrupt: nothing to repair"


def test_page_blocks_all_carry_a_directive() -> None:
    """The page's structure (no cluster): the steps in order, the files written before use."""
    blocks = page_blocks(PAGE.read_text())
    assert tuple(b.name for b in blocks if b.kind == "run") == STEPS
    written: set[str] = set()
    for block in blocks:
        if block.kind == "file":
            doc = yaml.safe_load(block.body)
            assert doc["kind"] == "WeightUpdate", block.name
            written.add(block.name)
        for name in re.findall(r"-f (\S+\.yaml)", block.body):
            assert name in written, f"{block.name} applies {name} before the page writes it"
    assert localise("weightroll manifest /models/v2 --version v2", "/pv") == (
        "weightroll manifest /pv/v2 --version v2"
    )
    assert localise("uri: file:///models/v2", "/pv") == "uri: file:///models/v2"


def test_getting_started_runs_on_the_dev_cluster(
    injected: Fleet,
    prom: Prometheus,
    page: list[Block],
    tmp_path: Path,
) -> None:
    fleet = injected
    for crd in _MONITORING_CRDS:
        fleet.kubectl("apply", "-f", "-", input_=yaml.safe_dump(crd))
    for crd in _MONITORING_CRDS:
        fleet.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd['metadata']['name']}"
        )
    runner = PageRun(fleet, tmp_path)
    outputs: dict[str, str] = {}
    for block in page:
        if block.kind == "file":
            (tmp_path / block.name).write_text(block.body)
            continue
        if block.name == "failed-rollout":
            fleet.corrupt(BAD, "v3")
        if block.name == "retry":
            _repair(fleet, BAD, "v3")
        outputs[block.name] = runner.run(block)
        check = CHECKS.get(block.name)
        if check is not None:
            check(fleet, prom, outputs[block.name])
    # what the page's commands printed, for the log of a passing run (pytest -rP)
    print("\n".join(runner.transcript))


# ----------------------------------------------------------------- what each step must leave


def _installed(fleet: Fleet, prom: Prometheus, out: str) -> None:
    assert f"NAME: {RELEASE}" in out and f"NAMESPACE: {NAMESPACE}" in out, out
    import helm_python

    config = helm_python.Config(kubeconfig_path=fleet.info.kubeconfig, namespace=NAMESPACE)
    try:
        release = config.status(RELEASE)
    finally:
        config.close()
    assert release["status"] == "deployed", release


def _pods_listed(fleet: Fleet, prom: Prometheus, out: str) -> None:
    for pod in fleet.pods:
        assert pod in out, out
        assert fleet.condition(pod, "Ready") == "True", pod


def _manifest(version: str) -> Callable[[Fleet, Prometheus, str], None]:
    def check(fleet: Fleet, prom: Prometheus, out: str) -> None:
        # `weightroll manifest` prints the manifest's pin; the file is where the update names it
        path = Path(fleet.info.checkpoints[version]["path"]) / "weightroll-manifest.json"
        assert json.loads(path.read_text())["version"] == version, path
        assert out.strip().startswith("sha256:"), out

    return check


def _first_rollout(fleet: Fleet, prom: Prometheus, out: str) -> None:
    assert "llama-v2" in out, out
    status = fleet.weightupdate("llama-v2")["status"]
    assert status["phase"] == "Succeeded", status
    assert status["replicas"]["verified"] == len(fleet.pods), status
    for pod in fleet.pods:
        assert fleet.condition(pod, GATE) == "True", pod


def _failed(fleet: Fleet, prom: Prometheus, out: str) -> None:
    status = fleet.weightupdate("llama-v3")["status"]
    assert status["phase"] == "Failed", status
    assert fleet.condition(BAD, GATE) == "False", f"{BAD} serves after failing"
    assert fleet.condition(BAD, "Ready") == "False", BAD
    failed = prom.wait(
        "WeightrollUpdateFailed firing for llama-v3",
        lambda: _firing(prom, "WeightrollUpdateFailed", namespace=NAMESPACE, name="llama-v3"),
        timeout=ALERT_SLACK,
    )
    assert failed[0]["labels"]["severity"] == "critical", failed
    runbook = failed[0]["annotations"]["runbook_url"]
    assert runbook.endswith("docs/runbooks/WeightrollUpdateFailed.md"), runbook
    assert "](runbooks/WeightrollUpdateFailed.md)" in PAGE.read_text()
    drained = prom.wait(
        f"WeightrollReplicaLeftDrained firing for {BAD}",
        lambda: _firing(prom, "WeightrollReplicaLeftDrained", pod=BAD),
        timeout=ALERT_SLACK,
    )
    assert drained[0]["labels"]["name"] == "llama-v3", drained
    assert drained[0]["annotations"]["runbook_url"].endswith(
        "docs/runbooks/WeightrollReplicaLeftDrained.md"
    )


def _failed_status(fleet: Fleet, prom: Prometheus, out: str) -> None:
    assert "Failed" in out and BAD in out, out
    # The fleet served v2 when llama-v3 started: that is its stable version, not the v1 the
    # pods served before llama-v2 (what the previous owner's states record as previous).
    assert "(stable: v2)" in out, out


def _recovered(fleet: Fleet, prom: Prometheus, out: str) -> None:
    status = fleet.weightupdate("llama-v3")["status"]
    assert status["phase"] == "Succeeded", status
    assert status["replicas"]["verified"] == len(fleet.pods), status
    for pod in fleet.pods:
        assert fleet.condition(pod, "Ready") == "True", pod
    prom.wait(
        "WeightrollUpdateFailed and WeightrollReplicaLeftDrained resolved after the retry",
        lambda: (
            not _firing(prom, "WeightrollUpdateFailed")
            and not _firing(prom, "WeightrollReplicaLeftDrained")
        ),
        timeout=ALERT_SLACK,
    )


CHECKS: dict[str, Callable[[Fleet, Prometheus, str], None]] = {
    "install": _installed,
    "pods": _pods_listed,
    "manifest": _manifest("v2"),
    "first-rollout": _first_rollout,
    "manifest-v3": _manifest("v3"),
    "failed-rollout": _failed,
    "failed-status": _failed_status,
    "retry": _recovered,
}


def test_every_step_is_checked() -> None:
    assert set(CHECKS) == set(STEPS)


def test_helm_stand_in_reads_set_as_helm_does() -> None:
    """The ``--set`` subset the page uses, typed as Helm's ``strvals`` types it."""
    assert set_values(
        ["a.b=registry.example.com/x:0.1.0", "a.c=true", "d=3", "e={ml,team-b}", "a.f=false"]
    ) == {
        "a": {"b": "registry.example.com/x:0.1.0", "c": True, "f": False},
        "d": 3,
        "e": ["ml", "team-b"],
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        set_values(["novalue"])
