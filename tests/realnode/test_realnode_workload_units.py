"""Pure parts of ``dev up --node real``: the chart values, the Deployment patch that runs the
checkout's Python in the tiny image, and the sampler's verdicts. Fast; no root."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from weightroll_dev.realnode.images import TINY_IMAGE
from weightroll_dev.realnode.sampler import budget_breaches, judge, serving_accepted
from weightroll_dev.realnode.workload import host_python_patch, real_node_values

from engine_agent.protocol import AgentState, EngineState


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("home = /opt/python/bin\n")
    return venv


def _deployment() -> dict[str, Any]:
    return {
        "spec": {
            "template": {
                "spec": {
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                    "containers": [
                        {"name": "vllm", "command": ["vllm", "serve"],
                         "args": ["/models/v1", "--port=8000"],
                         "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}]},
                        {"name": "weightroll-agent", "command": ["weightroll-agent"],
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 65532}},
                    ],
                    "volumes": [{"name": "models", "hostPath": {"path": "/pv"}}],
                }
            }
        }
    }  # fmt: skip


def test_values_use_the_tiny_image_a_hostpath_and_no_operator_pods() -> None:
    values = real_node_values("v1", "t", 2, Path("/pv"))
    example = values["workloadExample"]
    assert example["replicas"] == 2
    assert example["vllm"]["image"] == example["agent"]["image"] == TINY_IMAGE
    assert example["vllm"]["resources"] == example["agent"]["resources"] == {}
    assert example["vllm"]["host"] == "0.0.0.0"  # the Service's endpoints carry traffic
    assert example["models"]["volume"] == {
        "persistentVolumeClaim": None,
        "hostPath": {"path": "/pv", "type": "Directory"},
    }
    assert values["operator"]["replicas"] == 0


def test_patch_runs_the_venv_as_root_with_vllm_as_a_module(tmp_path: Path) -> None:
    venv = _venv(tmp_path)
    original = _deployment()
    patched = host_python_patch(original, venv, tmp_path, "/co:/co/operator", "v1")
    assert original == _deployment()  # the input is left alone
    spec = patched["spec"]["template"]["spec"]
    assert spec["securityContext"] == {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0}
    vllm, agent = spec["containers"]
    assert vllm["command"] == [str(venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm["args"] == ["--model=/models/v1", "--port=8000"]
    assert agent["command"] == ["weightroll-agent"]
    for container in (vllm, agent):
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["PATH"].startswith(f"{venv / 'bin'}:")
        assert env["PYTHONPATH"] == "/co:/co/operator"
        assert env["WEIGHTROLL_BOOT_VERSION"] == "v1"
        assert container["securityContext"]["runAsUser"] == 0
        assert container["imagePullPolicy"] == "Never"
        paths = [m["mountPath"] for m in container["volumeMounts"]]
        shm = ["/dev/shm"] if container is vllm else []
        assert paths == [*shm, "/usr", "/opt/python", str(tmp_path)]  # venv in the checkout
    assert {e["name"] for e in vllm["env"]} >= {"VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE"}
    assert [v["name"] for v in spec["volumes"]] == ["models", "host-0", "host-1", "host-2", "dshm"]


def test_patch_refuses_a_workload_of_another_shape(tmp_path: Path) -> None:
    deployment = _deployment()
    deployment["spec"]["template"]["spec"]["containers"].pop()
    with pytest.raises(ValueError, match="not vllm"):
        host_python_patch(deployment, _venv(tmp_path), tmp_path, "", "v1")


#: ``GET /v1/state`` bodies as the agent sends them (``AgentState.to_wire``: camelCase).
SERVING_V1 = AgentState(version="v1", engine_state=EngineState.CLEAN, ready=True, paused=False)
UPDATING = AgentState(
    version="v1", engine_state=EngineState.CLEAN, ready=False, paused=False, active_update_id="u1"
)


def test_serving_accepted() -> None:
    assert serving_accepted(SERVING_V1.to_wire(), ("v1", "v2"))
    assert not serving_accepted(SERVING_V1.to_wire(), ("v2",))
    assert not serving_accepted(UPDATING.to_wire(), ("v1", "v2"))
    in_update = SERVING_V1.model_copy(update={"active_update_id": "u1"})
    assert not serving_accepted(in_update.to_wire(), ("v1",))
    assert not serving_accepted(None, ("v1",))


def test_a_ready_endpoint_is_blamed_only_when_both_agent_reads_say_not_serving() -> None:
    serving, updating = SERVING_V1.to_wire(), UPDATING.to_wire()
    sample: dict[str, Any] = {
        "pods": {"a": "10.0.0.1", "b": "10.0.0.2"},
        "agents_before": {"10.0.0.1": updating, "10.0.0.2": updating},
        "endpoints": {"10.0.0.1": True, "10.0.0.2": False},
        "agents_after": {"10.0.0.1": updating, "10.0.0.2": updating},
    }
    assert len(judge([sample], ("v1", "v2")).unverified) == 1  # b is not ready: not blamed
    sample["agents_after"] = {"10.0.0.1": serving, "10.0.0.2": updating}
    assert judge([sample], ("v1", "v2")).unverified == []  # a finished between the reads


def test_a_pod_named_in_accepted_for_is_judged_by_its_own_versions() -> None:
    """A replacement (or restarted) pod in traffic on its boot weights is blamed though the
    other pods may still serve that version."""
    serving = SERVING_V1.to_wire()
    sample: dict[str, Any] = {
        "pods": {"old": "10.0.0.1", "new": "10.0.0.2"},
        "agents_before": {"10.0.0.1": serving, "10.0.0.2": serving},
        "endpoints": {"10.0.0.1": True, "10.0.0.2": True},
        "agents_after": {"10.0.0.1": serving, "10.0.0.2": serving},
    }
    assert judge([sample], ("v1", "v2")).unverified == []
    (blamed,) = judge([sample], ("v1", "v2"), accepted_for={"new": ("v2",)}).unverified
    assert blamed.startswith("new (10.0.0.2) is a ready endpoint; accepted ['v2']")


def test_an_engine_that_answers_nothing_is_dead_not_unverified() -> None:
    """vLLM killed, the probe not failed twice yet: the endpoint serves no weights."""
    down = {**SERVING_V1.to_wire(), "version": "", "ready": False, "ranks": []}
    sample: dict[str, Any] = {
        "pods": {"a": "10.0.0.1"},
        "agents_before": {"10.0.0.1": down},
        "endpoints": {"10.0.0.1": True},
        "agents_after": {"10.0.0.1": down},
    }
    verdict = judge([sample], ("v2",))
    assert verdict.unverified == [] and len(verdict.dead) == 1
    # The ranks answer on boot weights: that is serving, and blamed.
    sample["agents_after"] = {"10.0.0.1": SERVING_V1.to_wire()}
    assert len(judge([sample], ("v2",)).unverified) == 1


def test_an_agent_that_does_not_answer_is_judged_by_its_last_answer() -> None:
    """A frozen agent: its pod still serves what it served; one never heard from is blamed."""
    serving = SERVING_V1.to_wire()
    heard = {
        "pods": {"a": "10.0.0.1"},
        "endpoints": {"10.0.0.1": True},
        "agents_before": {"10.0.0.1": serving},
        "agents_after": {"10.0.0.1": serving},
    }
    silent = {**heard, "agents_before": {"10.0.0.1": None}, "agents_after": {"10.0.0.1": None}}
    assert judge([heard, silent], ("v1",)).unverified == []
    assert len(judge([silent], ("v1",)).unverified) == 1
    assert len(judge([heard, silent], ("v2",)).unverified) == 2


def test_budget_counts_selected_pods_missing_or_unready_in_the_slice() -> None:
    sample = {"pods": {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"},
              "endpoints": {"10.0.0.1": True, "10.0.0.2": False}}  # fmt: skip
    assert budget_breaches(sample, 2) == []
    assert budget_breaches(sample, 1) == ["2 selected pods not ready endpoints: ['b', 'c']"]


@pytest.mark.parametrize("flag", ["--inject", "--reference=v2", "--first-ip=20"])
def test_dev_up_refuses_stand_in_flags_with_the_real_node(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightroll_dev.devcluster import dev
    from weightroll_dev.realnode import devcluster

    def must_not_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("a real node was started")

    monkeypatch.setattr(devcluster, "up", must_not_start)  # never a node from a unit test
    directory = tmp_path / "dev"
    assert dev.main(["up", "--node", "real", flag, "--dir", str(directory)]) == 2
    assert not directory.exists()  # refused before anything was started
