"""Operator configuration (``WEIGHTROLL_*`` environment variables and CLI flags) and the one
place where kopf's settings are set (called from the ``on.startup`` handler).

Never log a :class:`OperatorConfig` at DEBUG with credentials in it: it holds none by design (the
agent token is read from the Secret named in each WeightUpdate).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import kopf

__all__ = ["FINALIZER", "PREFIX", "OperatorConfig", "configure_kopf"]

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
    #: Seconds an agent's ``/v1/state`` answer is reused for an unchanged pod.
    state_ttl: float = 30.0
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> OperatorConfig:
        """The defaults, then ``WEIGHTROLL_<FIELD>`` variables, then non-``None`` ``overrides``.

        Raises:
            ValueError: a variable does not parse as its field's type (the message names it).
        """
        env = os.environ if environ is None else environ
        defaults = cls()
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = f"WEIGHTROLL_{f.name.upper()}"
            raw = env.get(var)
            if raw is not None:
                values[f.name] = _parse(var, raw, type(getattr(defaults, f.name)))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


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


def configure_kopf(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """Progress in annotations under ``weightroll.io``, our finalizer, quiet kopf Events."""
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
