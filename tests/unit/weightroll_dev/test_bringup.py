"""The dev cluster's bookkeeping without a cluster: ``cluster.json``, the WeightUpdate it names,
and ``dev down``'s sweep (it stops what carries the directory's marker, and nothing else)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from weightroll_dev.devcluster import bringup
from weightroll_dev.devcluster.bringup import ENV_MARKER, ClusterInfo, down, leftovers
from weightroll_operator.api import v1alpha1 as api

from tests.docs.test_examples import _schema_errors


def _info(directory: Path) -> ClusterInfo:
    pv = directory / "pv-models"
    return ClusterInfo(
        kubeconfig=str(directory / "kube" / "kubeconfig"),
        namespace="weightroll-system",
        selector={"app.kubernetes.io/name": "vllm-example"},
        tokenSecret="vllm-example-weightroll-token",
        checkpoints={v: bringup._checkpoint(pv, v) for v in ("v1", "v2", "v3")},
        pods={"vllm-example-0": "http://127.0.0.10:8000/v1"},
        agents={"vllm-example-0": "http://127.0.0.10:8470"},
        agentToken="t",
        servedModel="tiny",
        references={},
        podVolumes={"vllm-example-0": str(directory / "pods" / "vllm-example-0")},
        persistentVolume=str(pv),
        operatorMetricsUrl="http://127.0.0.1:1/metrics",
        operatorLog=str(directory / "operator.log"),
        operatorPid=1,
        supervisorPid=1,
        dir=str(directory),
    )


def test_cluster_json_round_trips_and_names_checkpoints_as_a_weightupdate_does(
    tmp_path: Path,
) -> None:
    info = _info(tmp_path)
    info.write()
    assert ClusterInfo.load(tmp_path) == info
    assert info.checkpoints["v2"] == {
        "uri": "file:///models/v2",
        "manifest": "file:///models/v2/weightroll-manifest.json",
        "path": str(tmp_path / "pv-models" / "v2"),
    }
    assert info.host("vllm-example-0") == "127.0.0.10"


def test_its_weightupdate_is_valid_for_the_crd_and_the_operator(tmp_path: Path) -> None:
    doc = _info(tmp_path).weightupdate("to-v2", "v2", on_failure="Rollback")
    assert _schema_errors(doc) == []
    spec = api.parse_spec(doc["spec"])
    assert spec.to_json_dict()["source"]["manifest"] == "file:///models/v2/weightroll-manifest.json"
    assert doc["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "vllm-example"}


def test_down_stops_what_carries_the_marker_and_spares_a_stale_pid(tmp_path: Path) -> None:
    directory = tmp_path.resolve()
    marked = subprocess.Popen(["sleep", "300"], env={**os.environ, ENV_MARKER: str(directory)})
    other = subprocess.Popen(["sleep", "300"], env={**os.environ, ENV_MARKER: "/elsewhere"})
    try:
        # A stale PID file naming a process that is not the cluster's must not get signalled.
        (directory / bringup.PID_FILE).write_text(f"{other.pid}\n")
        _info(directory).write()
        assert leftovers(directory) == [marked.pid]
        assert down(directory, say=lambda _: None, timeout=5) == 1
        assert marked.wait(30) == -9
        assert other.poll() is None
        assert leftovers(directory) == []
        assert not (directory / bringup.CLUSTER_JSON).exists()
        assert not (directory / bringup.PID_FILE).exists()
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait(30)
