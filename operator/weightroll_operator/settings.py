"""Operator configuration (``WEIGHTROLL_*`` environment variables and CLI flags) and the one
place where kopf's settings are set (called from the ``on.startup`` handler).

Never log a :class:`OperatorConfig` at DEBUG with credentials in it: it holds none by design (the
agent token is read from the Secret named in each WeightUpdate).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import kopf

__all__ = ["FINALIZER", "PREFIX", "OperatorConfig", "configure_kopf", "is_pattern"]

#: Annotation prefix of kopf's progress and diff-base storage on WeightUpdates.
PREFIX = "weightroll.io"
FINALIZER = f"{PREFIX}/finalizer"


@dataclass(frozen=True, slots=True)
class OperatorConfig:
    """Every knob of the operator process. Environment: ``WEIGHTROLL_<FIELD>`` (upper case)."""

    #: Seconds between passes of a WeightUpdate with nothing in flight (a resync: pod and
    #: WeightUpdate events start a pass at once, ``loop.py``).
    interval: float = 5.0
    #: Seconds between passes while units are in flight: an agent's commit is seen this soon.
    poll_interval: float = 0.5
    #: Seconds an agent answers before the call counts as unreachable.
    agent_timeout: float = 5.0
    #: Parallel agent and pod calls per pass.
    concurrency: int = 32
    #: The most pods one pass starts a forward step on (claim, update start, completion,
    #: restore; a unit is never split); the rest follow in the next pass, at once. Bounds the
    #: time of one pass (and so how long other WeightUpdates and the Lease renewal wait) when a
    #: batch is large: at 10,000 pods and maxUnavailable 10 % a batch is 1,000 pods. Drains,
    #: aborts and failures are never limited. As the ReplicaSet controller's burstReplicas.
    burst: int = 250
    #: Seconds between full cyclic garbage collections; between them the heap that survived a
    #: pass is frozen out of the collector (``gc_pacing.py``). 0: CPython's own collection.
    gc_full_interval: float = 60.0
    #: Seconds an agent's ``/v1/state`` answer is reused for an unchanged pod.
    state_ttl: float = 30.0
    #: Seconds an agent token read from its Secret is reused. 0 (the default): read once per
    #: pass, so a Secret that loses its opt-in label is not sent from the next pass on, and a
    #: rotation's new first line is sent from the next pass on.
    token_ttl: float = 0.0
    #: Port of the Prometheus metrics endpoint (0 disables it).
    metrics_port: int = 8080
    #: Address the metrics endpoint binds to (``127.0.0.1`` for a local run).
    metrics_addr: str = "0.0.0.0"
    #: Port of the liveness endpoint ``/healthz`` (0 disables it).
    health_port: int = 8081
    #: Level of kopf's own Events posted on WeightUpdates (ours are always posted).
    posting_level: str = "WARNING"
    #: Seconds kopf's watch requests last before being re-opened (kopf#810).
    watch_server_timeout: int = 300
    #: Label selector of the pod watch (server-side), e.g. ``weightroll.io/managed=true``;
    #: empty: every pod of the watched namespaces. Every pod a WeightUpdate selects, and every
    #: pod to admit, must match it.
    pod_selector: str = ""
    #: Run kopf only while holding the ``coordination.k8s.io`` Lease below (``k8s/lease.py``):
    #: the chart runs two replicas, one acts, the other takes over within ``lease_seconds``.
    leader_elect: bool = False
    #: Name of the leader Lease.
    lease_name: str = "weightroll-operator"
    #: Namespace of the leader Lease (empty: ``$POD_NAMESPACE``, else ``default``).
    lease_namespace: str = ""
    #: Seconds the Lease stays taken without renewal (failover time after a crash).
    lease_seconds: float = 15.0
    #: Port of the validating admission webhook (HTTPS, ``webhook.py``; 0 disables it).
    webhook_port: int = 0
    #: Directory with the webhook's ``tls.crt`` and ``tls.key``.
    webhook_cert_dir: str = "/etc/weightroll/webhook"
    #: Address the webhook binds to.
    webhook_addr: str = "0.0.0.0"
    #: Set the readiness gate True on pods no WeightUpdate selects once their containers are
    #: ready, so they serve their boot weights (``domain/admission.py``). Off: such pods stay
    #: NotReady until a WeightUpdate verifies them.
    admit_unmanaged_pods: bool = True
    #: Liveness fails when WeightUpdates exist and no reconcile pass finished for longer than
    #: this many ``interval`` s (a stalled loop, kopf#1276, is restarted); 0 disables the check.
    liveness_stall_intervals: float = 12.0
    #: CA bundle (PEM) that agents' TLS certificates must chain to; empty: plain HTTP to agents.
    #: Set, every agent call is HTTPS and verified (no fallback).
    agent_ca_file: str = ""
    #: TLS server name an agent's certificate must carry; ``{namespace}`` is the pod's namespace.
    agent_server_name: str = "weightroll-agent.{namespace}.svc"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> OperatorConfig:
        """The defaults, then ``WEIGHTROLL_<FIELD>`` variables, then non-``None`` ``overrides``.

        Raises:
            ValueError: a variable does not parse as its field's type, or a value is out of its
                field's range (the message names the variable or flag, and what it accepts).
        """
        env = os.environ if environ is None else environ
        defaults = cls()
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for f in fields(cls):
            var = f"WEIGHTROLL_{f.name.upper()}"
            raw = env.get(var)
            if raw is not None:
                values[f.name] = _parse(var, raw, type(getattr(defaults, f.name)))
                sources[f.name] = var
        for name, value in overrides.items():
            if value is not None:
                values[name] = value
                sources[name] = "--" + name.replace("_", "-")
        for name, value in values.items():
            problem = _out_of_range(name, value)
            if problem:
                raise ValueError(f"{sources[name]}={value!r}: {problem}")
        return cls(**values)


#: Fields with a lower bound: (least value, whether the least value itself is allowed, what the
#: bound protects). A zero burst would start one unit per pass, a zero interval a busy loop.
_LOWER_BOUNDS: dict[str, tuple[float, bool, str]] = {
    "interval": (0, False, "seconds between passes"),
    "poll_interval": (0, False, "seconds between passes while units are in flight"),
    "agent_timeout": (0, False, "seconds an agent call may take"),
    "concurrency": (1, True, "parallel agent and pod calls"),
    "burst": (1, True, "pods one pass starts a forward step on"),
    "gc_full_interval": (0, True, "seconds between full collections (0: CPython's own)"),
    "state_ttl": (0, True, "seconds an agent answer is reused"),
    "token_ttl": (0, True, "seconds an agent token is reused"),
    "watch_server_timeout": (1, True, "seconds a watch request lasts"),
    "lease_seconds": (0, False, "seconds the Lease stays taken"),
    "liveness_stall_intervals": (0, True, "intervals without a pass before liveness fails"),
}
_PORTS = ("metrics_port", "health_port", "webhook_port")
_POSTING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _out_of_range(name: str, value: Any) -> str:
    """Why ``value`` is not acceptable for field ``name``, or ``""`` when it is."""
    if name in _LOWER_BOUNDS:
        least, inclusive, meaning = _LOWER_BOUNDS[name]
        # Written as "not within" so that NaN (every comparison false) is refused too.
        if not (value >= least if inclusive else value > least):
            bound = f"at least {least:g}" if inclusive else f"greater than {least:g}"
            return f"must be {bound} ({meaning})"
    if name in _PORTS and not 0 <= value <= 65535:
        return "must be a port from 1 to 65535, or 0 to disable it"
    if name == "posting_level" and value not in _POSTING_LEVELS:
        return f"must be one of {', '.join(_POSTING_LEVELS)}"
    return ""


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _parse(var: str, raw: str, kind: type) -> Any:
    """One variable as ``kind``; booleans by word, since ``bool("false")`` is True."""
    if kind is bool:
        word = raw.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise ValueError(f"{var}={raw!r}: expected one of true/false, 1/0, yes/no, on/off")
    try:
        return kind(raw)
    except ValueError as e:
        raise ValueError(f"{var}={raw!r}: not a valid {kind.__name__}") from e


def is_pattern(namespace: str) -> bool:
    """A kopf namespace pattern (glob or exclusion) rather than one plain namespace name."""
    return any(ch in namespace for ch in "*?[]!,")


def configure_kopf(
    settings: kopf.OperatorSettings, config: OperatorConfig, namespaces: Sequence[str] = ()
) -> None:
    """Progress in annotations under ``weightroll.io``, our finalizer, quiet kopf Events.

    Watching plain namespaces only, cluster scanning is off: kopf then neither lists namespaces
    nor watches CRDs (it discovers the WeightUpdate API once, through API discovery), so the
    operator needs no cluster-scoped permission at all (the chart's per-namespace Roles).
    """
    if namespaces and not any(is_pattern(ns) for ns in namespaces):
        settings.scanning.disabled = True
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.getLevelName(config.posting_level)
    settings.watching.server_timeout = config.watch_server_timeout
    settings.watching.client_timeout = config.watch_server_timeout + 30
    settings.networking.request_timeout = 30
    if config.pod_selector:
        settings.watching.label_selectors["pods"] = config.pod_selector
