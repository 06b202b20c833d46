"""The validating admission webhook for WeightUpdates: bad input is rejected at the door.

Issue 11 finding 9: an empty selector, ``In`` without values, ``sparse`` without
``baseVersion``, a source that is not a local path, a ``progressDeadlineSeconds`` below the
unit timeout, an empty ``tokenSecretRef.key`` or a non-canonical version (``V2_1`` would share
its update id with ``v2-1``) used to be accepted by the API server and found later, in status.
:func:`review` answers an ``AdmissionReview`` with the same parsing the operator applies
(``api/v1alpha1.py``), so the message of a rejection names the field exactly like an
``InvalidSpec`` condition would, plus the rules only the door enforces:

* ``spec.source`` is immutable while ``spec.version`` is unchanged: the same version from
  another checkpoint would make "verified at v" ambiguous (roll a new version instead);
* ``progressDeadlineSeconds`` is greater than ``updateTimeoutSeconds``: otherwise one slow unit
  fails the whole rollout before its own timeout (the deadline counts from the claim, the
  unit's timer from the agent's acceptance). The operator still runs such a spec stored before
  the webhook existed (the deadline then fires first);
* ``maxFailedReplicas`` is less than a numeric ``maxUnavailable``: tolerated failed units stay
  drained and use the budget, so that many would stop the rollout (the operator halts such a
  rollout at once, ``domain/halts.py``).

An UPDATE that leaves ``spec`` as it was is always allowed, so an object stored before the
webhook existed (or before a rule was added) can still get its finalizer removed and be deleted.

:func:`mutate_review` answers the pod-injection webhook (``POST /mutate``, issue 31 item 1): for
a pod labelled ``weightroll.io/inject: "true"`` a JSON Patch from ``domain/injection.py``, or a
refusal naming the missing piece; any other pod is allowed untouched. Without injection
settings (``WEIGHTROLL_INJECT_AGENT_IMAGE`` empty) every opted-in pod is refused with that reason:
the chart registers the mutating webhook fail-closed, so a pod never starts half-prepared.

:class:`WebhookServer` serves ``POST /validate`` and ``POST /mutate`` over HTTPS with the
certificate the chart (or the caller) provides. Every operator replica serves both, leader or not
(``main.py``): admission is stateless, and the Service in front of the replicas may route to any
of them.

Why not kopf's admission server: it runs inside ``kopf.operator``, which only the leader runs.

Limitations: the webhook sees one object at a time; rules across WeightUpdates (two selecting
the same pods) stay with the operator (``Blocked`` condition).
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from weightroll_operator.api.v1alpha1 import parse_spec
from weightroll_operator.domain.halts import budget_problem, deadline_problem
from weightroll_operator.domain.injection import InjectionSettings, Refusal, inject
from weightroll_operator.domain.wire import check_wire

__all__ = ["MUTATE_PATH", "WEBHOOK_PATH", "WebhookServer", "mutate_review", "review", "validate"]

log = logging.getLogger(__name__)

#: Path of the validating webhook (the chart's ValidatingWebhookConfiguration points here).
WEBHOOK_PATH = "/validate"
#: Path of the pod-injection webhook (the chart's MutatingWebhookConfiguration points here).
MUTATE_PATH = "/mutate"
#: Why an opted-in pod is refused by an operator without injection settings.
NOT_CONFIGURED = (
    "weightroll pod injection is not configured on the operator (WEIGHTROLL_INJECT_AGENT_IMAGE "
    "is empty; the chart sets it with webhook.inject.enabled)"
)


def validate(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> str | None:
    """Why ``new`` (replacing ``old`` on UPDATE) is not an acceptable WeightUpdate, or ``None``.

    Returns:
        A message naming every offending field (``spec.a.b: ...``), or ``None`` when valid.
    """
    spec = new.get("spec")
    old_spec = None if old is None else old.get("spec")
    if old is not None and spec == old_spec:
        return None  # metadata-only update (finalizers, annotations): never blocked
    try:
        parsed = parse_spec(spec)
        # what the agent's wire protocol refuses (a NUL in a path): refused here, not later
        check_wire(parsed, str((new.get("metadata") or {}).get("name") or "new"))
    except ValueError as e:
        return str(e)
    # specs that fail by construction (``domain/halts.py``)
    problem = deadline_problem(parsed.strategy) or budget_problem(parsed.strategy)
    if problem is not None:
        return problem
    same_version = isinstance(old_spec, Mapping) and old_spec.get("version") == parsed.version
    if same_version and (old_spec or {}).get("source") != (spec or {}).get("source"):
        return (
            "spec.source is immutable while spec.version is unchanged "
            f"({parsed.version}): publish the new checkpoint under a new spec.version"
        )
    return None


def review(body: Mapping[str, Any]) -> dict[str, Any]:
    """Answer one ``AdmissionReview`` (``admission.k8s.io/v1`` or ``v1beta1``)."""
    request = body.get("request") or {}
    uid = request.get("uid", "")
    operation = request.get("operation")
    new = request.get("object") or {}
    old = request.get("oldObject") if operation == "UPDATE" else None
    problem = validate(new, old) if operation in ("CREATE", "UPDATE") else None
    response: dict[str, Any] = {"uid": uid, "allowed": problem is None}
    if problem is not None:
        response["status"] = {"code": 422, "reason": "Invalid", "message": problem}
        meta = new.get("metadata") or {}
        log.info(
            "Rejected %s of WeightUpdate %s/%s: %s",
            operation,
            meta.get("namespace") or request.get("namespace"),
            meta.get("name") or request.get("name"),
            problem,
        )
    return {
        "apiVersion": body.get("apiVersion", "admission.k8s.io/v1"),
        "kind": "AdmissionReview",
        "response": response,
    }


def mutate_review(body: Mapping[str, Any], settings: InjectionSettings | None) -> dict[str, Any]:
    """Answer one pod ``AdmissionReview``: a JSON Patch completing an opted-in pod, a refusal
    naming what is missing, or an untouched allow (not opted in, nothing to add, not CREATE)."""
    request = body.get("request") or {}
    pod = request.get("object") or {}
    outcome: list[dict[str, Any]] | Refusal = []
    if request.get("operation") == "CREATE":
        if settings is None:
            probe = inject(pod, _PROBE)
            outcome = Refusal(NOT_CONFIGURED) if probe else probe
        else:
            outcome = inject(pod, settings)
    response: dict[str, Any] = {"uid": request.get("uid", ""), "allowed": True}
    meta = pod.get("metadata") or {}
    where = f"{request.get('namespace') or meta.get('namespace')}/"
    where += str(meta.get("name") or meta.get("generateName") or "")
    if isinstance(outcome, Refusal):
        response["allowed"] = False
        response["status"] = {"code": 422, "reason": "Invalid", "message": outcome.message}
        log.info("Refused injection into Pod %s: %s", where, outcome.message)
    elif outcome:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(outcome).encode()).decode()
        log.info("Injected weightroll into Pod %s (%d additions)", where, len(outcome))
    return {
        "apiVersion": body.get("apiVersion", "admission.k8s.io/v1"),
        "kind": "AdmissionReview",
        "response": response,
    }


#: Stands in for missing settings to tell an opted-in pod that would need injection from the rest
#: (an unlabelled pod or a fully hand-prepared one is still admitted).
_PROBE = InjectionSettings(agent_image="-", token_secret="-", tls=False)


async def _body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


async def _handle(request: web.Request) -> web.Response:
    body = await _body(request)
    if body is None:
        return web.json_response({"message": "expected an AdmissionReview"}, status=400)
    return web.json_response(review(body))


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@dataclass
class WebhookServer:
    """HTTPS server of :data:`WEBHOOK_PATH` and :data:`MUTATE_PATH`.

    Args:
        port: TCP port (0: pick a free one; :attr:`bound_port` says which).
        cert_dir: directory with ``tls.crt`` and ``tls.key`` (a ``kubernetes.io/tls`` Secret).
        host: address to bind (``0.0.0.0`` in a pod, ``127.0.0.1`` locally).
        injection: what ``/mutate`` injects (``None``: opted-in pods are refused).
    """

    port: int
    cert_dir: Path
    host: str = "0.0.0.0"
    injection: InjectionSettings | None = None
    bound_port: int = 0
    _runner: web.AppRunner | None = None

    def _ssl(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cert_dir / "tls.crt", self.cert_dir / "tls.key")
        return ctx

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post(WEBHOOK_PATH, _handle)
        app.router.add_post(MUTATE_PATH, self._mutate)
        app.router.add_get("/healthz", _ok)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=self._ssl())
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.bound_port = sockets[0].getsockname()[1] if sockets else self.port
        log.info("Serving the admission webhook on https://%s:%d%s", self.host, self.bound_port,
                 WEBHOOK_PATH)  # fmt: skip

    async def _mutate(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body is None:
            return web.json_response({"message": "expected an AdmissionReview"}, status=400)
        return web.json_response(mutate_review(body, self.injection))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
