"""Pod injection (issue 31 item 1): what the mutating webhook adds to an opted-in vLLM pod.

A pod labelled ``weightroll.io/inject: "true"`` gets the four pieces a platform team used to
hand-edit into every vLLM pod template (the chart's ``weightroll.workload.*`` helpers):

1. the readiness gate ``weightroll.io/weights-ready``;
2. vLLM's flags: ``--worker-extension-cls`` (the extension), ``--host=127.0.0.1`` (unless the
   container names its own ``--host``: the dev routes then follow the owner's choice) and
   ``VLLM_SERVER_DEV_MODE=1``;
3. the ``weightroll-agent`` sidecar: port 8470 named ``weightroll``, ``/readyz`` readiness and
   ``/healthz`` liveness probes, the token file, the state directory, TLS when the operator
   verifies agents, and the checkpoint volume mounted read-only at vLLM's own mount path;
4. the volumes: the agent token Secret (key ``token``), the TLS Secret, the state directory.

:func:`inject` is the single source of truth: ``tests/charts/test_injection_render.py`` checks
that injecting the chart's label-only example equals the hand-written one, piece by piece.

Invariants:

* never touches a pod without the opt-in label (:func:`inject` returns no operation);
* idempotent: every piece is added only when absent (by name, flag or condition type), so an
  injected pod gets no operation on re-admission (``reinvocationPolicy: IfNeeded``);
* only ``add`` operations, never a replace or remove: what the owner wrote stays as written;
* a pod that cannot be completed is refused (:class:`Refusal`), with a message naming the
  missing piece, rather than admitted half-prepared (it would never turn Ready).

Per-workload facts come from the pod's annotations (``weightroll.io/agent-token-secret``,
``weightroll.io/agent-tls-secret``, ``weightroll.io/vllm-container``,
``weightroll.io/models-volume``, ``weightroll.io/initial-version``/``-source``/``-manifest``),
falling back to the operator's :class:`InjectionSettings` (``WEIGHTROLL_INJECT_*``).

Limitations: trainer pushes (``--trainer-token-file``, trainer networks) and signed manifests
(``WEIGHTROLL_AGENT_MANIFEST_PUBLIC_KEY``) are not injected (hand-add them, or use the chart's
helpers); vLLM's flags are appended to ``args``, so a container must run vLLM directly (``vllm
serve ...``), not through a shell.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AGENT_CONTAINER",
    "AGENT_PORT",
    "EXTENSION_CLS",
    "INJECT_LABEL",
    "READINESS_GATE",
    "InjectionSettings",
    "Refusal",
    "inject",
    "opted_in",
]

#: The opt-in label (a label, not an annotation: the webhook's objectSelector can match it, so
#: the API server calls the webhook only for opted-in pods and fails closed only for them).
INJECT_LABEL = "weightroll.io/inject"
READINESS_GATE = "weightroll.io/weights-ready"
AGENT_CONTAINER = "weightroll-agent"
AGENT_PORT = 8470
EXTENSION_CLS = "engine_agent.vllm_extension.WeightRollExtension"
LOOPBACK = "127.0.0.1"
DEFAULT_VLLM_PORT = 8000
TOKEN_DIR = "/var/run/weightroll"
TLS_DIR = "/var/run/weightroll-tls"
STATE_DIR = "/var/lib/weightroll"

#: Per-workload annotations (each overrides the operator's setting of the same meaning).
ANNOTATION_TOKEN_SECRET = "weightroll.io/agent-token-secret"
ANNOTATION_TLS_SECRET = "weightroll.io/agent-tls-secret"
ANNOTATION_VLLM_CONTAINER = "weightroll.io/vllm-container"
ANNOTATION_MODELS_VOLUME = "weightroll.io/models-volume"
ANNOTATION_INITIAL_VERSION = "weightroll.io/initial-version"
ANNOTATION_INITIAL_SOURCE = "weightroll.io/initial-source"
ANNOTATION_INITIAL_MANIFEST = "weightroll.io/initial-manifest"

_RESTRICTED = {
    "allowPrivilegeEscalation": False,
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

Op = dict[str, Any]


@dataclass(frozen=True, slots=True)
class InjectionSettings:
    """What the operator injects (from ``WEIGHTROLL_INJECT_*`` and ``WEIGHTROLL_AGENT_CA_FILE``).

    An empty name means "the pod must name it in its annotation".
    """

    #: Image of the agent sidecar (keep it the vLLM image's release).
    agent_image: str
    #: Default agent token Secret (key ``token``); ``weightroll.io/agent-token-secret`` wins.
    token_secret: str = ""
    #: Serve TLS on the agent port (the operator verifies agents: ``agent_ca_file`` is set).
    tls: bool = False
    #: Default TLS Secret (``tls.crt``, ``tls.key``); ``weightroll.io/agent-tls-secret`` wins.
    tls_secret: str = ""
    #: Default name of the checkpoint volume; ``weightroll.io/models-volume`` wins.
    models_volume: str = "models"
    #: Resources of the agent container (a Kubernetes ``ResourceRequirements``).
    agent_resources: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.agent_image:
            raise ValueError("the agent image is required to inject the agent sidecar")


@dataclass(frozen=True, slots=True)
class Refusal:
    """A pod the webhook cannot complete; ``message`` names the missing piece."""

    message: str


def opted_in(pod: Mapping[str, Any]) -> bool:
    """Whether the pod carries ``weightroll.io/inject: "true"``."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(INJECT_LABEL, "")).lower() == "true"


def inject(pod: Mapping[str, Any], settings: InjectionSettings) -> list[Op] | Refusal:
    """The JSON Patch (RFC 6902, ``add`` only) that completes ``pod``, or why it cannot be.

    Args:
        pod: the Pod as the API server sends it (``request.object``).
        settings: the operator's injection settings.

    Returns:
        The operations, in order (empty: nothing to add, or the pod did not opt in), or a
        :class:`Refusal` naming the missing piece.
    """
    if not opted_in(pod):
        return []
    meta = pod.get("metadata") or {}
    notes: Mapping[str, Any] = meta.get("annotations") or {}
    spec: Mapping[str, Any] = pod.get("spec") or {}
    containers: Sequence[Mapping[str, Any]] = spec.get("containers") or []
    vllm_name = str(notes.get(ANNOTATION_VLLM_CONTAINER) or "vllm")
    index = next((i for i, c in enumerate(containers) if c.get("name") == vllm_name), None)
    if index is None:
        return Refusal(
            f"vLLM container not found: the pod has no container named {vllm_name!r} (name "
            f"it in the {ANNOTATION_VLLM_CONTAINER} annotation)"
        )
    vllm = containers[index]
    volume = str(notes.get(ANNOTATION_MODELS_VOLUME) or settings.models_volume)
    mount = next((m for m in vllm.get("volumeMounts") or [] if m.get("name") == volume), None)
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    if mount is None or volume not in volumes:
        return Refusal(
            f"no checkpoint volume: container {vllm_name!r} mounts no pod volume named "
            f"{volume!r} (the checkpoints vLLM and the agent read; name it in the "
            f"{ANNOTATION_MODELS_VOLUME} annotation)"
        )
    # The Secrets are needed only for volumes still to add (a hand-prepared pod names none).
    token_secret = str(notes.get(ANNOTATION_TOKEN_SECRET) or settings.token_secret)
    if not token_secret and "weightroll-token" not in volumes:
        return Refusal(
            f"no agent token Secret: set the {ANNOTATION_TOKEN_SECRET} annotation (the Secret "
            "with key `token` the operator reads from the WeightUpdate's tokenSecretRef)"
        )
    tls_secret = str(notes.get(ANNOTATION_TLS_SECRET) or settings.tls_secret)
    if settings.tls and not tls_secret and "weightroll-tls" not in volumes:
        return Refusal(
            f"no agent TLS Secret: the operator verifies agents over TLS; set the "
            f"{ANNOTATION_TLS_SECRET} annotation (a Secret with tls.crt and tls.key)"
        )
    tokens = [*(vllm.get("command") or []), *(vllm.get("args") or [])]
    ops: list[Op] = []
    gates = spec.get("readinessGates")
    if not any(g.get("conditionType") == READINESS_GATE for g in gates or []):
        _append(ops, "/spec/readinessGates", gates, {"conditionType": READINESS_GATE})
    base = f"/spec/containers/{index}"
    flags: list[str] = []
    if not _has_flag(tokens, "--host"):
        flags.append(f"--host={LOOPBACK}")
    if not _has_flag(tokens, "--worker-extension-cls"):
        flags.append(f"--worker-extension-cls={EXTENSION_CLS}")
    args = vllm.get("args")
    for flag in flags:
        _append(ops, f"{base}/args", args, flag)
        args = [*(args or []), flag]
    env = vllm.get("env")
    if not any(e.get("name") == "VLLM_SERVER_DEV_MODE" for e in env or []):
        _append(ops, f"{base}/env", env, {"name": "VLLM_SERVER_DEV_MODE", "value": "1"})
    if not any(c.get("name") == AGENT_CONTAINER for c in containers):
        agent = _agent(
            settings,
            port=_flag_value(tokens, "--port") or str(DEFAULT_VLLM_PORT),
            models=mount,
            initial=_initial(notes, tokens),
        )
        ops.append({"op": "add", "path": "/spec/containers/-", "value": agent})
    pod_volumes = spec.get("volumes")
    for wanted in _volumes(token_secret, tls_secret if settings.tls else ""):
        if wanted["name"] not in volumes:
            _append(ops, "/spec/volumes", pod_volumes, wanted)
            pod_volumes = [*(pod_volumes or []), wanted]
    return ops


def _append(ops: list[Op], path: str, current: Sequence[Any] | None, value: Any) -> None:
    """Append ``value`` to the list at ``path``, creating the list when absent."""
    if current is None:
        ops.append({"op": "add", "path": path, "value": [value]})
    else:
        ops.append({"op": "add", "path": f"{path}/-", "value": value})


def _has_flag(tokens: Sequence[str], flag: str) -> bool:
    return any(t == flag or t.startswith(f"{flag}=") for t in tokens)


def _flag_value(tokens: Sequence[str], flag: str) -> str | None:
    for i, t in enumerate(tokens):
        if t.startswith(f"{flag}="):
            return t.split("=", 1)[1]
        if t == flag and i + 1 < len(tokens):
            return tokens[i + 1]
    return None


def _initial(notes: Mapping[str, Any], tokens: Sequence[str]) -> list[Op]:
    """The boot weights' env (as the chart's ``workloadExample.initialWeights``): the version,
    the source (the annotation, else vLLM's model when it is an absolute path), the manifest."""
    env: list[Op] = []
    version = notes.get(ANNOTATION_INITIAL_VERSION)
    if version:
        env.append({"name": "WEIGHTROLL_AGENT_INITIAL_VERSION", "value": str(version)})
    source = notes.get(ANNOTATION_INITIAL_SOURCE) or _served_model(tokens)
    if source:
        env.append({"name": "WEIGHTROLL_AGENT_INITIAL_SOURCE", "value": str(source)})
    manifest = notes.get(ANNOTATION_INITIAL_MANIFEST)
    if manifest:
        env.append({"name": "WEIGHTROLL_AGENT_INITIAL_MANIFEST", "value": str(manifest)})
    return env


def _served_model(tokens: Sequence[str]) -> str:
    """The model after ``serve`` (``vllm serve /models/current ...``), if an absolute path."""
    if "serve" in tokens:
        i = tokens.index("serve") + 1
        if i < len(tokens) and tokens[i].startswith("/"):
            return tokens[i]
    return ""


def _agent(
    settings: InjectionSettings, port: str, models: Mapping[str, Any], initial: list[Op]
) -> dict[str, Any]:
    """The sidecar, exactly as the chart's ``weightroll.workload.agentContainer`` writes it."""
    args = [f"--vllm-url=http://{LOOPBACK}:{port}", f"--token-file={TOKEN_DIR}/token",
            f"--state-dir={STATE_DIR}"]  # fmt: skip
    mounts: list[dict[str, Any]] = [
        {"name": "weightroll-token", "mountPath": TOKEN_DIR, "readOnly": True}
    ]
    if settings.tls:
        args += [f"--tls-cert-file={TLS_DIR}/tls.crt", f"--tls-key-file={TLS_DIR}/tls.key"]
        mounts.append({"name": "weightroll-tls", "mountPath": TLS_DIR, "readOnly": True})
    mounts += [
        {"name": "weightroll-state", "mountPath": STATE_DIR},
        {"name": models["name"], "mountPath": models["mountPath"], "readOnly": True},
    ]

    def probe(path: str, period: int, failures: int) -> dict[str, Any]:
        get: dict[str, Any] = {"path": path, "port": "weightroll"}
        if settings.tls:
            get["scheme"] = "HTTPS"
        return {"httpGet": get, "periodSeconds": period, "failureThreshold": failures}

    agent: dict[str, Any] = {
        "name": AGENT_CONTAINER,
        "image": settings.agent_image,
        "command": ["weightroll-agent"],
        "args": args,
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "WEIGHTROLL_AGENT_MODEL_DIR", "value": str(models["mountPath"])},
            *initial,
        ],
        "ports": [{"name": "weightroll", "containerPort": AGENT_PORT}],
        "readinessProbe": probe("/readyz", 5, 2),
        "livenessProbe": probe("/healthz", 15, 4),
        "volumeMounts": mounts,
        "securityContext": copy.deepcopy(_RESTRICTED),
    }
    if settings.agent_resources:
        agent["resources"] = copy.deepcopy(dict(settings.agent_resources))
    return agent


def _volumes(token_secret: str, tls_secret: str) -> list[dict[str, Any]]:
    """The token Secret (mode 0400), the TLS Secret (when set) and the state directory."""
    volumes: list[dict[str, Any]] = [
        {
            "name": "weightroll-token",
            "secret": {
                "secretName": token_secret,
                "defaultMode": 0o400,
                "items": [{"key": "token", "path": "token"}],
            },
        }
    ]
    if tls_secret:
        volumes.append(
            {
                "name": "weightroll-tls",
                "secret": {
                    "secretName": tls_secret,
                    "defaultMode": 0o400,
                    "items": [
                        {"key": "tls.crt", "path": "tls.crt"},
                        {"key": "tls.key", "path": "tls.key"},
                    ],
                },
            }
        )
    volumes.append({"name": "weightroll-state", "emptyDir": {}})
    return volumes
