"""Operator configuration (``WEIGHTROLL_*`` environment variables and CLI flags) and the one
place where kopf's settings are set (called from the ``on.startup`` handler).

Never log a :class:`OperatorConfig` at DEBUG with credentials in it: it holds none by design (the
agent token is read from the Secret named in each WeightUpdate).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args, get_origin

import kopf
from annotated_types import Ge, Gt, Le
from pydantic import AfterValidator, BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from weightroll_operator.domain.injection import InjectionSettings

__all__ = ["FINALIZER", "PREFIX", "OperatorConfig", "configure_kopf", "is_pattern"]

#: Annotation prefix of kopf's progress and diff-base storage on WeightUpdates.
PREFIX = "weightroll.io"
FINALIZER = f"{PREFIX}/finalizer"

_MAX_PORT = 65535
#: A TCP port, 0 disabling what listens on it.
_Port = Annotated[int, Field(ge=0, le=_MAX_PORT)]
#: A boolean variable as a word (true/false, yes/no, on/off, 1/0), surrounding blanks ignored.
_Switch = Annotated[bool, BeforeValidator(lambda v: v.strip() if isinstance(v, str) else v)]


def _json_object(text: str) -> str:
    """``text`` when it is empty or a JSON object (else a ValueError naming what it is)."""
    if text.strip():
        try:
            value = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
    return text


class OperatorConfig(BaseSettings):
    """Every knob of the operator process. Environment: ``WEIGHTROLL_<FIELD>`` (upper case).

    ``OperatorConfig(...)`` is its arguments over the defaults (no environment);
    :meth:`from_env` reads the variables. Bounds are the fields' constraints (a zero burst would
    start one unit per pass, a zero interval a busy loop); NaN and infinities are refused.
    """

    model_config = SettingsConfigDict(
        env_prefix="WEIGHTROLL_", frozen=True, extra="forbid", allow_inf_nan=False
    )

    #: Seconds between passes of a WeightUpdate with nothing in flight (a resync: pod and
    #: WeightUpdate events start a pass at once, ``loop.py``).
    interval: float = Field(5.0, gt=0, description="seconds between passes")
    #: Seconds between passes while units are in flight: an agent's commit is seen this soon.
    poll_interval: float = Field(
        0.5, gt=0, description="seconds between passes while units are in flight"
    )
    #: Seconds an agent answers before the call counts as unreachable.
    agent_timeout: float = Field(5.0, gt=0, description="seconds an agent call may take")
    #: Parallel agent and pod calls per pass.
    concurrency: int = Field(32, ge=1, description="parallel agent and pod calls")
    #: The most pods one pass starts a forward step on (claim, update start, completion,
    #: restore; a unit is never split); the rest follow in the next pass, at once. Bounds the
    #: time of one pass (and so how long other WeightUpdates and the Lease renewal wait) when a
    #: batch is large: at 10,000 pods and maxUnavailable 10 % a batch is 1,000 pods. Drains,
    #: aborts and failures are never limited. As the ReplicaSet controller's burstReplicas.
    burst: int = Field(250, ge=1, description="pods one pass starts a forward step on")
    #: Seconds between full cyclic garbage collections; between them the heap that survived a
    #: pass is frozen out of the collector (``gc_pacing.py``). 0: CPython's own collection.
    gc_full_interval: float = Field(
        60.0, ge=0, description="seconds between full collections (0: CPython's own)"
    )
    #: Seconds an agent's ``/v1/state`` answer is reused for an unchanged pod.
    state_ttl: float = Field(30.0, ge=0, description="seconds an agent answer is reused")
    #: Seconds an agent token read from its Secret is reused. 0 (the default): read once per
    #: pass, so a Secret that loses its opt-in label is not sent from the next pass on, and a
    #: rotation's new first line is sent from the next pass on.
    token_ttl: float = Field(0.0, ge=0, description="seconds an agent token is reused")
    #: Port of the Prometheus metrics endpoint (0 disables it).
    metrics_port: _Port = 8080
    #: Address the metrics endpoint binds to (``127.0.0.1`` for a local run).
    metrics_addr: str = "0.0.0.0"
    #: Port of the liveness endpoint ``/healthz`` (0 disables it).
    health_port: _Port = 8081
    #: Level of kopf's own Events posted on WeightUpdates (ours are always posted).
    posting_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "WARNING"
    #: Seconds kopf's watch requests last before being re-opened (kopf#810).
    watch_server_timeout: int = Field(300, ge=1, description="seconds a watch request lasts")
    #: Label selector of the pod watch (server-side), e.g. ``weightroll.io/managed=true``;
    #: empty: every pod of the watched namespaces. Every pod a WeightUpdate selects, and every
    #: pod to admit, must match it.
    pod_selector: str = ""
    #: Run kopf only while holding the ``coordination.k8s.io`` Lease below (``k8s/lease.py``):
    #: the chart runs two replicas, one acts, the other takes over within ``lease_seconds``.
    leader_elect: _Switch = False
    #: Name of the leader Lease.
    lease_name: str = "weightroll-operator"
    #: Namespace of the leader Lease (empty: ``$POD_NAMESPACE``, else ``default``).
    lease_namespace: str = ""
    #: Seconds the Lease stays taken without renewal (failover time after a crash).
    lease_seconds: float = Field(15.0, gt=0, description="seconds the Lease stays taken")
    #: Port of the validating admission webhook (HTTPS, ``webhook.py``; 0 disables it).
    webhook_port: _Port = 0
    #: Directory with the webhook's ``tls.crt`` and ``tls.key``.
    webhook_cert_dir: str = "/etc/weightroll/webhook"
    #: Address the webhook binds to.
    webhook_addr: str = "0.0.0.0"
    #: Set the readiness gate True on pods no WeightUpdate selects once their containers are
    #: ready, so they serve their boot weights (``domain/admission.py``). Off: such pods stay
    #: NotReady until a WeightUpdate verifies them.
    admit_unmanaged_pods: _Switch = True
    #: Liveness fails when WeightUpdates exist and no reconcile pass finished for longer than
    #: this many ``interval`` s (a stalled loop, kopf#1276, is restarted); 0 disables the check.
    liveness_stall_intervals: float = Field(
        12.0, ge=0, description="intervals without a pass before liveness fails"
    )
    #: CA bundle (PEM) that agents' TLS certificates must chain to; empty: plain HTTP to agents.
    #: Set, every agent call is HTTPS and verified (no fallback).
    agent_ca_file: str = ""
    #: TLS server name an agent's certificate must carry; ``{namespace}`` is the pod's namespace.
    agent_server_name: str = "weightroll-agent.{namespace}.svc"
    #: Image of the agent sidecar the pod-injection webhook (``POST /mutate``) adds to pods
    #: labelled ``weightroll.io/inject: "true"``; empty: injection off (such pods are refused).
    inject_agent_image: str = ""
    #: Default agent token Secret (key ``token``) of injected pods; a pod's
    #: ``weightroll.io/agent-token-secret`` annotation wins (empty: the pod must name it).
    inject_token_secret: str = ""
    #: Default TLS Secret (``tls.crt``, ``tls.key``) of injected agents when ``agent_ca_file``
    #: is set (agents then serve TLS); ``weightroll.io/agent-tls-secret`` wins.
    inject_tls_secret: str = ""
    #: Default name of the pod volume holding the checkpoints (mounted by vLLM; the agent gets
    #: it at the same path); ``weightroll.io/models-volume`` wins.
    inject_models_volume: str = "models"
    #: Resources of the injected agent container: a JSON ``ResourceRequirements`` object, kept
    #: as text so the config stays hashable (empty: none).
    inject_agent_resources: Annotated[str, AfterValidator(_json_object)] = Field(
        "", description='a JSON object, e.g. {"limits": {"memory": "256Mi"}}'
    )

    def injection(self) -> InjectionSettings | None:
        """What ``POST /mutate`` injects; ``None`` while :attr:`inject_agent_image` is empty.

        Agents serve TLS exactly when the operator verifies them (:attr:`agent_ca_file`): one
        switch, so an injected pod and the operator never disagree on the scheme.
        """
        if not self.inject_agent_image:
            return None
        return InjectionSettings(
            agent_image=self.inject_agent_image,
            token_secret=self.inject_token_secret,
            tls=bool(self.agent_ca_file),
            tls_secret=self.inject_tls_secret,
            models_volume=self.inject_models_volume,
            agent_resources=json.loads(self.inject_agent_resources or "{}"),
        )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """The constructor's arguments only: :meth:`from_env` passes the variables it read."""
        return (init_settings,)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> OperatorConfig:
        """The defaults, then ``WEIGHTROLL_<FIELD>`` variables (of ``environ``, else the process
        environment), then non-``None`` ``overrides`` (the command line's flags).

        Raises:
            ValueError: a variable does not parse as its field's type, or a value is out of its
                field's range (one line naming each variable or flag, and what it accepts).
        """
        variables = _Variables(cls, os.environ if environ is None else environ)()
        flags = {name: value for name, value in overrides.items() if value is not None}
        try:
            return cls(**(variables | flags))
        except ValidationError as e:
            raise ValueError(_refusal(cls, e, variables, flags)) from None


class _Variables(EnvSettingsSource):
    """pydantic-settings' environment source over one mapping (tests pass a dict)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        fold = (lambda k: k) if self.case_sensitive else str.lower
        return {fold(name): value for name, value in self._environ.items()}


def _refusal(
    cls: type[BaseSettings],
    error: ValidationError,
    variables: Mapping[str, Any],
    flags: Mapping[str, Any],
) -> str:
    """One line: each refused value as given, named as its flag (``--burst``) or variable, and
    what the field accepts."""
    problems: dict[str, None] = {}
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else ""
        if name in flags:
            where, given = f"--{name.replace('_', '-')}", flags[name]
        else:
            where, given = f"WEIGHTROLL_{name.upper()}", variables.get(name, problem["input"])
        field = cls.model_fields.get(name)
        accepts = f"must be {_accepts(field)}" if field else problem["msg"]
        problems[f"{where}={given!r}: {accepts}"] = None
    return "; ".join(problems)


def _accepts(field: FieldInfo) -> str:
    """What ``field`` accepts, from its type and constraints (and its description)."""
    kind = field.annotation
    if kind is bool:
        return "one of true/false, yes/no, on/off, 1/0"
    if get_origin(kind) is Literal:
        return "one of " + ", ".join(map(str, get_args(kind)))
    gt = next((m.gt for m in field.metadata if isinstance(m, Gt)), None)
    ge = next((m.ge for m in field.metadata if isinstance(m, Ge)), None)
    le = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    if le == _MAX_PORT:
        return f"a port from 1 to {_MAX_PORT}, or 0 to disable it"
    text = "a whole number" if kind is int else "a number" if kind is float else "text"
    if gt is not None:
        text += f" greater than {gt:g}"
    elif ge is not None:
        text += f" at least {ge:g}"
    return f"{text} ({field.description})" if field.description else text


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
