"""Pure parts of the pod simulator (weightroll_dev.devcluster.podspec): command lines and
the status kubelet would write. Fast; no cluster, no vLLM (these run in every tier)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from weightroll_dev.devcluster.podspec import (
    VLLM_MODULE,
    ContainerState,
    PodSpecError,
    build_argv,
    build_env,
    pod_status,
    status_differs,
)

ROOT = Path("/sim/pod-0/rootfs/c")
BIN = Path(sys.executable).parent
IP = "127.0.0.12"
GATE = "weightroll.io/weights-ready"

VLLM = {
    "name": "vllm",
    "command": ["vllm", "serve"],
    "args": ["/models/v1", "--host=127.0.0.1", "--port=8000", "--served-model-name=tiny"],
    "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
    "volumeMounts": [{"name": "models", "mountPath": "/models"}],
}
AGENT = {
    "name": "weightroll-agent",
    "command": ["weightroll-agent"],
    "args": [
        "--vllm-url=http://127.0.0.1:8000",
        "--token-file=/var/run/weightroll/token",
        "--initial-source=file:///models/v1",
    ],
}
MOUNTS = ["/models", "/var/run/weightroll"]


def _argv(container: dict[str, object]) -> list[str]:
    return build_argv(container, mounts=MOUNTS, root=ROOT, pod_ip=IP, python="/py", bin_dir=BIN)


def test_vllm_serve_runs_the_api_server_on_the_pod_ip_with_pod_paths() -> None:
    assert _argv(VLLM) == [
        "/py",
        "-m",
        VLLM_MODULE,
        "--model",
        f"{ROOT}/models/v1",
        f"--host={IP}",
        "--port=8000",
        "--served-model-name=tiny",
    ]


def test_agent_gets_pod_ip_source_root_and_keeps_pod_view_sources() -> None:
    argv = _argv(AGENT)
    assert Path(argv[0]).name == "weightroll-agent"
    assert argv[1:] == [
        f"--vllm-url=http://{IP}:8000",
        f"--token-file={ROOT}/var/run/weightroll/token",
        "--initial-source=file:///models/v1",
        f"--host={IP}",
        f"--source-root={ROOT}",
    ]


def test_env_is_rewritten_except_pod_view_uris() -> None:
    env = build_env(
        {
            "env": [
                {"name": "URL", "value": "http://localhost:1"},
                {"name": "WEIGHTROLL_AGENT_INITIAL_SOURCE", "value": "/models/v1"},
                # the jail of sources: pod view, resolved under --source-root by the agent
                {"name": "WEIGHTROLL_AGENT_MODEL_DIR", "value": "/models"},
                {"name": "P", "value": "/models/x"},
            ]
        },
        base={"A": "1"},
        mounts=MOUNTS,
        root=ROOT,
        pod_ip=IP,
    )
    assert env == {
        "A": "1",
        "URL": f"http://{IP}:1",
        "WEIGHTROLL_AGENT_INITIAL_SOURCE": "/models/v1",
        "WEIGHTROLL_AGENT_MODEL_DIR": "/models",
        "P": f"{ROOT}/models/x",
    }


def test_a_container_without_command_is_refused() -> None:
    with pytest.raises(PodSpecError, match=r"containers\[x\]\.command is required"):
        _argv({"name": "x", "image": "busybox"})


def _status(gate: str | None, ready: bool = True) -> dict[str, object]:
    observed = {} if gate is None else {GATE: {"type": GATE, "status": gate}}
    return pod_status(
        pod_ip=IP,
        start_time="t0",
        containers=[ContainerState("vllm", "img", "running", ready, 0, "t0")],
        gates=[GATE],
        observed=observed,
        now="t1",
    )


def _conds(status: dict[str, object]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status["conditions"]}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("gate", "containers_ready", "ready"),
    [
        (None, True, "False"),
        ("False", True, "False"),
        ("True", True, "True"),
        ("True", False, "False"),
    ],
)
def test_ready_needs_containers_and_every_gate(
    gate: str | None, containers_ready: bool, ready: str
) -> None:
    status = _status(gate, containers_ready)
    conds = _conds(status)
    assert conds["Ready"] == ready
    assert conds["ContainersReady"] == ("True" if containers_ready else "False")
    assert GATE not in conds  # never written by the kubelet
    assert status["phase"] == "Running" and status["podIP"] == IP


def test_transition_time_kept_while_status_unchanged() -> None:
    observed = {"Ready": {"type": "Ready", "status": "True", "lastTransitionTime": "t-old"}}
    status = pod_status(
        pod_ip=IP,
        start_time="t0",
        containers=[ContainerState("c", "img", "running", True, 0, "t0")],
        gates=[],
        observed=observed,
        now="t-new",
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["lastTransitionTime"] == "t-old"
    assert not status_differs(status, {**status, "startTime": "other"})
    assert status_differs(status, _status("False"))
