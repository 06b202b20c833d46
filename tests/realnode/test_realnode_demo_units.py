"""``make demo NODE=real``: the argument's way from make to the demo, and the demo's cluster on
the real node (no node is brought up here: its bring-up is stubbed at the module boundary)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from weightroll_dev import demo_cluster
from weightroll_dev.demo_view import Console
from weightroll_dev.devcluster.bringup import ClusterInfo
from weightroll_dev.realnode.demo import DemoNode, cluster_info

REPO = Path(__file__).resolve().parents[2]

REAL_INFO: dict[str, Any] = {
    "kubeconfig": "/d/node/apiserver/kubeconfig",
    "netns": "weightroll-0123abcd",
    "namespace": "weightroll-system",
    "selector": {"app.kubernetes.io/name": "vllm-example"},
    "tokenSecret": "vllm-example-weightroll-token",
    "agentToken": "t",
    "servedModel": "tiny",
    "checkpoints": {"v2": {"uri": "file:///models/v2", "manifest": "file:///models/v2/m.json"}},
    "pods": {"vllm-example-7d-b": "10.88.0.5", "vllm-example-7d-a": "10.88.0.4"},
    "operatorPid": 42,
    "operatorMetricsUrl": "http://127.0.0.1:9100/metrics",
    "operatorLog": "/d/operator.log",
}


@pytest.mark.parametrize(("node", "flag"), [(None, "--node stand-in"), ("real", "--node real")])
def test_make_demo_passes_node_to_the_demo(node: str | None, flag: str) -> None:
    argv = ["make", "-n", "demo"] + ([f"NODE={node}"] if node else [])
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True).stdout
    commands = out.replace("\\\n", " ").splitlines()
    (line,) = [c for c in commands if "-m weightroll_dev demo" in c]
    assert line.rstrip().endswith(flag)


def test_the_fail_scenario_is_refused_on_the_real_node(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_cluster.main(["--node", "real", "--scenario", "fail"]) == 2
    assert "share one volume" in capsys.readouterr().err


def test_cluster_info_reaches_vllm_and_agents_at_the_pod_addresses() -> None:
    info = cluster_info(Path("/d"), REAL_INFO)
    assert info.pods["vllm-example-7d-a"] == "http://10.88.0.4:8000/v1"
    assert info.agents["vllm-example-7d-b"] == "http://10.88.0.5:8470"
    assert info.host("vllm-example-7d-a") == "10.88.0.4"
    assert info.operatorMetricsUrl == REAL_INFO["operatorMetricsUrl"]
    assert info.weightupdate("u", "v2")["spec"]["source"]["uri"] == "file:///models/v2"


def test_the_demo_runs_on_the_real_node_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def up(self: DemoNode, pods: int, say: object) -> ClusterInfo:
        calls.append(f"real up {pods}")
        self.netns = REAL_INFO["netns"]
        return cluster_info(tmp_path, REAL_INFO)

    monkeypatch.setattr(DemoNode, "up", up)
    monkeypatch.setattr(DemoNode, "down", lambda self, say: calls.append("real down"))
    monkeypatch.setattr(demo_cluster, "up", lambda *a, **k: calls.append("stand-in up"))
    monkeypatch.setattr(demo_cluster, "down", lambda *a, **k: calls.append("stand-in down"))
    demo = demo_cluster.ClusterDemo(tmp_path, Console(tty=False), "ok", "Halt", node="real")
    demo.bring_up()
    # The ReplicaSet names the pods; the demo follows them, not the stand-in's names.
    assert demo.names == ("vllm-example-7d-a", "vllm-example-7d-b")
    assert set(demo.seen) == set(demo.names)
    demo.close()
    assert calls == ["real up 3", "real down"]
