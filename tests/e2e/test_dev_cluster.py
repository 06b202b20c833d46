"""``weightroll_dev dev up`` / ``weightroll_dev dev down`` (issue 13 B) as a user runs them.

``dev up --pods 3 --dir D`` returns with the cluster running in the background and
``D/cluster.json`` describing it; ``kubectl --kubeconfig <its kubeconfig> get pods`` shows three
Ready pods (the API server's own view, not our bookkeeping) whose vLLM servers answer at the URLs
given with the boot checkpoint's sentence. ``dev down`` then stops everything: no live process
names ``D`` on its command line or carries its marker.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path

import pytest
from weightroll_dev.demomodels import PROMPT, answer
from weightroll_dev.devcluster.bringup import leftovers

from tests.e2e.conftest import dev_down, dev_up, processes_naming, skip_without_dev_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.server, pytest.mark.timeout(1200)]


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        out: dict[str, object] = json.loads(resp.read())
        return out


def test_dev_up_serves_three_ready_pods_and_dev_down_leaves_nothing(tmp_path: Path) -> None:
    skip_without_dev_cluster()
    directory = (tmp_path / "dev").resolve()
    _, out = dev_up(directory, "--pods", "3")
    try:
        assert "Dev cluster up" in out, out[-3000:]
        data = json.loads((directory / "cluster.json").read_text())
        assert {"kubeconfig", "namespace", "selector", "tokenSecret", "checkpoints", "pods"} <= set(
            data
        )
        ns, kubeconfig = data["namespace"], data["kubeconfig"]
        assert sorted(data["checkpoints"]) == ["v1", "v2", "v3"]
        for version, checkpoint in data["checkpoints"].items():
            assert checkpoint["uri"] == f"file:///models/{version}"
            assert checkpoint["manifest"] == f"file:///models/{version}/weightroll-manifest.json"
            assert (Path(checkpoint["path"]) / "weightroll-manifest.json").is_file()

        def kubectl(*args: str) -> str:
            done = subprocess.run(
                ["kubectl", "--kubeconfig", kubeconfig, *args],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout

        rows = [r.split() for r in kubectl("get", "pods", "-n", ns).splitlines()[1:]]
        assert len(rows) == 3 and all(r[1:3] == ["2/2", "Running"] for r in rows), rows
        selector = ",".join(f"{k}={v}" for k, v in data["selector"].items())
        pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json"))["items"]
        ready = {
            p["metadata"]["name"]
            for p in pods
            for c in p["status"]["conditions"]
            if c["type"] == "Ready" and c["status"] == "True"
        }
        assert ready == set(data["pods"]) and len(ready) == 3, (ready, data["pods"])
        kubectl("get", "secret", data["tokenSecret"], "-n", ns)
        for url in data["pods"].values():
            body = {"model": data["servedModel"], "prompt": PROMPT, "max_tokens": 48}
            text = _post(f"{url}/completions", {**body, "temperature": 0})["choices"]
            assert text[0]["text"] == answer("v1"), text  # type: ignore[index]
        assert leftovers(directory), "the running cluster's processes carry no marker"
    finally:
        dev_down(directory)
    assert leftovers(directory) == []
    assert processes_naming(directory) == []
    assert not (directory / "cluster.json").exists()
