"""Pure pieces of the pod simulator: container command lines and the status kubelet would write.

Everything here is a function of its arguments (no I/O, no clock), so it is unit-tested with
exact values (``tests/e2e/test_devcluster_units.py``).

How a container of a pod spec becomes a local process (the simulator has no images and no
network or mount namespaces):

* **Command.** ``command`` is required (an image's entrypoint cannot be known). Its first word is
  looked up next to the running Python (the project's virtualenv ``bin``), then on ``PATH``.
  ``vllm serve MODEL ...`` runs ``python -m vllm.entrypoints.openai.api_server --model MODEL
  ...`` (the same server without the CLI wrapper).
* **Network.** Every pod gets its own loopback address ``127.0.0.N`` (its ``podIP``). Inside a
  real pod ``127.0.0.1``/``localhost`` is the pod itself and ``0.0.0.0`` listens on the pod's
  interfaces, so those literals in ``args`` and ``env`` values become the pod IP; a known server
  (vLLM, ``weightroll-agent``) without ``--host`` gets ``--host=<podIP>``.
* **Files.** Each container sees its ``volumeMounts`` under its own root directory
  ``<pod dir>/rootfs/<container>`` (a symlink per mount path, to the pod's volume directory).
  Absolute paths in ``args`` and ``env`` values that lie under a mount path (also as ``file://``
  URIs) are rewritten to that root. The agent's ``--initial-source`` (a *pod-view* URI reported
  back to the operator) and ``--model-dir`` (the pod-view directory sources must stay in), and
  their env vars, are left as they are; instead ``weightroll-agent`` gets
  ``--source-root=<its root>`` and resolves every weight source (and the model dir) under it.

Status follows kubelet: ``Ready`` is True only when every container is ready **and** every
``spec.readinessGates`` condition is True on the pod (a missing condition counts as False);
``lastTransitionTime`` only moves when a condition's status changes.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "POD_VIEW_ENV",
    "POD_VIEW_FLAGS",
    "ContainerState",
    "PodSpecError",
    "build_argv",
    "build_env",
    "is_agent",
    "is_vllm",
    "pod_status",
    "readiness_gates",
    "rewrite_hosts",
    "rewrite_paths",
    "status_differs",
]

#: Flags whose values are pod-view paths or URIs (never rewritten).
POD_VIEW_FLAGS = ("--initial-source", "--model-dir")
#: Environment variables holding pod-view paths or URIs (never rewritten).
POD_VIEW_ENV = ("WEIGHTROLL_AGENT_INITIAL_SOURCE", "WEIGHTROLL_AGENT_MODEL_DIR")
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
_HOST_LITERAL = re.compile(r"(?<![\w.])(127\.0\.0\.1|0\.0\.0\.0|localhost)(?![\w.])")


class PodSpecError(ValueError):
    """The pod spec asks for something the simulator cannot run (message names the field)."""


def rewrite_hosts(value: str, pod_ip: str) -> str:
    """Replace loopback/wildcard host literals by the pod IP.

    >>> rewrite_hosts("http://127.0.0.1:8000", "127.0.0.12")
    'http://127.0.0.12:8000'
    """
    return _HOST_LITERAL.sub(pod_ip, value)


def _rewrite_path(value: str, mounts: Sequence[str], root: Path) -> str:
    scheme = "file://" if value.startswith("file://") else ""
    path = value.removeprefix(scheme)
    for mount in mounts:
        m = mount.rstrip("/") or "/"
        if path == m or path.startswith(m + "/"):
            return f"{scheme}{root}{path}"
    return value


def rewrite_paths(value: str, mounts: Sequence[str], root: Path) -> str:
    """Rewrite ``value`` (or the value of ``--flag=value``) when it lies under a mount path.

    >>> rewrite_paths("--model=/models/v1", ["/models"], Path("/r"))
    '--model=/r/models/v1'
    >>> rewrite_paths("file:///models/v1", ["/models"], Path("/r"))
    'file:///r/models/v1'
    """
    if value.startswith("--") and "=" in value:
        flag, _, rest = value.partition("=")
        if flag in POD_VIEW_FLAGS:
            return value
        return f"{flag}={_rewrite_path(rest, mounts, root)}"
    return _rewrite_path(value, mounts, root)


def _rewrite_args(args: Sequence[str], mounts: Sequence[str], root: Path, ip: str) -> list[str]:
    out: list[str] = []
    keep_next = False
    for arg in args:
        if keep_next:
            out.append(arg)
            keep_next = False
            continue
        if arg in POD_VIEW_FLAGS:
            keep_next = True
            out.append(arg)
            continue
        out.append(rewrite_hosts(rewrite_paths(arg, mounts, root), ip))
    return out


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def is_vllm(command: Sequence[str]) -> bool:
    return list(command[:2]) == ["vllm", "serve"] or VLLM_MODULE in command


def is_agent(command: Sequence[str]) -> bool:
    return len(command) >= 1 and Path(command[0]).name == "weightroll-agent"


def _resolve(exe: str, bin_dir: Path) -> str:
    local = bin_dir / exe
    if "/" not in exe and local.exists():
        return str(local)
    found = shutil.which(exe)
    if found is None:
        raise PodSpecError(f"command {exe!r} is neither in {bin_dir} nor on PATH")
    return found


def build_argv(
    container: Mapping[str, Any],
    *,
    mounts: Sequence[str],
    root: Path,
    pod_ip: str,
    python: str,
    bin_dir: Path,
) -> list[str]:
    """The local command line of one container (see the module docstring for the rules).

    Raises:
        PodSpecError: no ``command``, or an executable that cannot be found.
    """
    name = container.get("name", "?")
    command = [str(c) for c in container.get("command") or []]
    if not command:
        raise PodSpecError(
            f"containers[{name}].command is required: the simulator runs no images, only "
            "local commands"
        )
    args = _rewrite_args([str(a) for a in container.get("args") or []], mounts, root, pod_ip)
    command = [command[0], *_rewrite_args(command[1:], mounts, root, pod_ip)]
    if command[:2] == ["vllm", "serve"]:
        model = args[:1] if args and not args[0].startswith("-") else []
        rest = args[len(model) :]
        argv = [python, "-m", VLLM_MODULE, *(["--model", model[0]] if model else []), *rest]
    else:
        argv = [_resolve(command[0], bin_dir), *command[1:], *args]
    if (is_vllm(command) or is_agent(command)) and not _has_flag(argv, "--host"):
        argv.append(f"--host={pod_ip}")
    if is_agent(command) and not _has_flag(argv, "--source-root"):
        argv.append(f"--source-root={root}")
    return argv


def build_env(
    container: Mapping[str, Any],
    *,
    base: Mapping[str, str],
    mounts: Sequence[str],
    root: Path,
    pod_ip: str,
) -> dict[str, str]:
    """``base`` plus the container's literal ``env`` values, rewritten like ``args``.

    The downward API's ``fieldRef: status.podIP`` is the pod IP (the agent binds to it).

    Raises:
        PodSpecError: any other ``env`` entry with ``valueFrom`` (not simulated).
    """
    env = dict(base)
    for item in container.get("env") or []:
        field_path = ((item.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if field_path == "status.podIP":
            env[str(item["name"])] = pod_ip
            continue
        if "valueFrom" in item:
            raise PodSpecError(
                f"containers[{container.get('name')}].env[{item.get('name')}].valueFrom is "
                "not simulated"
            )
        value = str(item.get("value", ""))
        if item["name"] not in POD_VIEW_ENV:
            value = rewrite_hosts(rewrite_paths(value, mounts, root), pod_ip)
        env[str(item["name"])] = value
    return env


def readiness_gates(spec: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(str(g["conditionType"]) for g in spec.get("readinessGates") or [])


@dataclass(frozen=True, slots=True)
class ContainerState:
    """What the simulator knows about one container at one instant."""

    name: str
    image: str
    #: ``waiting``, ``running`` or ``terminated``.
    state: str
    ready: bool
    restart_count: int
    started_at: str | None = None
    exit_code: int | None = None
    reason: str | None = None

    def to_status(self) -> dict[str, Any]:
        if self.state == "running":
            state: dict[str, Any] = {"running": {"startedAt": self.started_at}}
        elif self.state == "terminated":
            state = {
                "terminated": {
                    "exitCode": self.exit_code if self.exit_code is not None else -1,
                    "reason": self.reason or "Error",
                    "startedAt": self.started_at,
                }
            }
        else:
            state = {"waiting": {"reason": self.reason or "ContainerCreating"}}
        return {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "ready": self.ready,
            "started": self.state == "running",
            "restartCount": self.restart_count,
            "state": state,
        }


def _condition(
    ctype: str,
    ok: bool,
    previous: Mapping[str, Mapping[str, Any]],
    now: str,
    reason: str | None = None,
    message: str | None = None,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    prev = previous.get(ctype) or {}
    since = prev.get("lastTransitionTime") if prev.get("status") == status else None
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": since or now,
    }
    if not ok and reason:
        cond["reason"] = reason
        cond["message"] = message or ""
    return cond


def pod_status(
    *,
    pod_ip: str,
    start_time: str,
    containers: Sequence[ContainerState],
    gates: Sequence[str],
    observed: Mapping[str, Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    """The ``status`` kubelet would write (phase, IPs, container statuses, conditions).

    Args:
        pod_ip: the pod's loopback address.
        start_time: when the simulator accepted the pod (RFC 3339).
        containers: the containers' current states.
        gates: ``spec.readinessGates`` condition types.
        observed: the pod's current conditions by type (gates and our own earlier writes).
        now: RFC 3339 timestamp for conditions that change now.

    Returns:
        The status body. Readiness-gate conditions are never included (their owners write them;
        a strategic merge patch leaves them alone).
    """
    unready = [c.name for c in containers if not c.ready]
    containers_ready = not unready
    gates_false = [g for g in gates if (observed.get(g) or {}).get("status") != "True"]
    running = all(c.state == "running" for c in containers)
    ready = containers_ready and not gates_false
    if not containers_ready:
        ready_reason, ready_msg = "ContainersNotReady", f"containers with unready status: {unready}"
    else:
        ready_reason = "ReadinessGatesNotReady"
        ready_msg = "; ".join(
            f'corresponding condition of pod readiness gate "{g}" does not exist.'
            if g not in observed
            else f'the status of pod readiness gate "{g}" is not "True", but False'
            for g in gates_false
        )
    conditions = [
        _condition("Initialized", True, observed, now),
        _condition(
            "ContainersReady",
            containers_ready,
            observed,
            now,
            "ContainersNotReady",
            f"containers with unready status: {unready}",
        ),
        _condition("Ready", ready, observed, now, ready_reason, ready_msg),
        _condition("PodScheduled", True, observed, now),
    ]
    return {
        "phase": "Running" if running else "Pending",
        "hostIP": "127.0.0.1",
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "conditions": conditions,
        "containerStatuses": [c.to_status() for c in containers],
    }


def _digest(status: Mapping[str, Any]) -> tuple[Any, ...]:
    conds = tuple(
        sorted(
            (c["type"], c["status"])
            for c in status.get("conditions") or []
            if c.get("type") in ("Initialized", "ContainersReady", "Ready", "PodScheduled")
        )
    )
    containers = tuple(
        (c.get("name"), c.get("ready"), c.get("restartCount"), tuple(sorted(c.get("state") or {})))
        for c in status.get("containerStatuses") or []
    )
    return (status.get("phase"), status.get("podIP"), conds, containers)


def status_differs(desired: Mapping[str, Any], observed: Mapping[str, Any]) -> bool:
    """True when the fields the simulator owns differ (timestamps ignored)."""
    return _digest(desired) != _digest(observed)
