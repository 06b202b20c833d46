"""Every kopf handler of the operator, registered on a given registry (house rule 3).

Bodies only call the reconciler and map errors: ``InvalidSpec`` -> ``PermanentError`` (the
status already says why; a spec change re-runs it), Kubernetes/agent errors -> ``TemporaryError``.
Pods and WeightUpdates are observed through ``@kopf.index``. The handlers on Pods are
``on.event`` handlers — admission (``domain/admission.py``) and the wake-up of the namespace's
WeightUpdate loops (``loop.py``): event handlers keep no progress and add no finalizer, unlike
kopf's change handlers, timers and daemons, so the operator writes nothing on a pod but its own
gate and annotations.

Each WeightUpdate has one daemon that runs passes (``loop.drive``): right after a watch event of
one of its namespace's pods, every ``pollInterval`` while units are in flight, every
``interval`` otherwise (issue 11 finding 10: a fixed 5 s timer delayed every step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from weightroll_operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from weightroll_operator.domain.admission import awaits_admission
from weightroll_operator.domain.fleet import trim_pod, trim_weightupdate
from weightroll_operator.errors import InvalidSpec, WeightrollError
from weightroll_operator.liveness import Liveness, Stalled
from weightroll_operator.loop import Wakeups, drive
from weightroll_operator.reconcile import PassResult, Reconciler, backoff_delay
from weightroll_operator.settings import OperatorConfig, configure_kopf

__all__ = ["Runtime", "register"]

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the handlers need: the reconciler and the config (built by ``main``)."""

    reconciler: Reconciler
    config: OperatorConfig
    #: The namespaces watched (``-n``); empty: every namespace.
    namespaces: tuple[str, ...] = ()
    #: The wake-up events of the running WeightUpdate loops.
    wakeups: Wakeups = field(default_factory=Wakeups)
    #: Finished passes, for the liveness probe (``liveness.py``).
    liveness: Liveness = field(init=False)

    def __post_init__(self) -> None:
        c = self.config
        self.liveness = Liveness(c.interval, c.liveness_stall_intervals, time.monotonic())


def _of(index: kopf.Index[str, Any], namespace: str | None) -> Iterable[Mapping[str, Any]]:
    return list(index.get(namespace or "", []))


def register(
    registry: kopf.OperatorRegistry,
    rt: Runtime,
    login: Callable[[], kopf.ConnectionInfo] | None = None,
) -> None:
    """Register the handlers on ``registry``.

    Args:
        registry: the kopf registry to fill.
        rt: the operator's runtime (reconciler, config).
        login: the credentials kopf uses; the operator's own API client uses the same ones, so
            both act as one identity (the chart's ServiceAccount in a cluster).
    """
    if login is not None:

        @kopf.on.login(id="login", registry=registry)
        def credentials(**_: Any) -> kopf.ConnectionInfo:
            return login()

    @kopf.on.startup(id="configure", registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, rt.config, rt.namespaces)

    @kopf.index("pods", id="pods_by_namespace", registry=registry)
    def pods_by_namespace(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, Any]:
        return {namespace or "": trim_pod(body)}

    @kopf.index(GROUP, VERSION, PLURAL, id="updates_by_namespace", registry=registry)
    def updates_by_namespace(namespace: str | None, body: kopf.Body, **_: Any) -> dict[str, Any]:
        return {namespace or "": trim_weightupdate(body)}

    def retry_in(kw: Mapping[str, Any]) -> float:
        # API and agent errors back off exponentially with jitter (kopf counts the retries).
        return backoff_delay(int(kw.get("retry") or 0) + 1, rt.config.interval, 300.0)

    async def run(body: kopf.Body, namespace: str | None, indices: Mapping[str, Any]) -> PassResult:
        pods, peers = indices["pods_by_namespace"], indices["updates_by_namespace"]
        try:
            return await rt.reconciler.reconcile(body, _of(pods, namespace), _of(peers, namespace))
        except InvalidSpec as e:
            raise kopf.PermanentError(str(e)) from e
        except WeightrollError as e:
            raise kopf.TemporaryError(str(e), delay=retry_in(indices)) from e
        finally:
            rt.liveness.passed(time.monotonic())

    # Explicit ids: they become annotation keys (weightroll.io/<id>) of kopf's progress storage.
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-create", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile-update", registry=registry)
    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-resume", registry=registry)
    async def reconcile_on_change(body: kopf.Body, namespace: str | None, **kw: Any) -> None:
        await run(body, namespace, kw)

    @kopf.daemon(GROUP, VERSION, PLURAL, id="reconcile-loop", registry=registry,
                 cancellation_timeout=10.0)  # fmt: skip
    async def reconcile_loop(
        body: kopf.Body, namespace: str | None, stopped: kopf.DaemonStopped, **kw: Any
    ) -> None:
        failures = calls_failed = 0
        # Backoffs stay under the liveness limit (``liveness_stall_intervals`` intervals without
        # a pass restarts the operator): with the jitter (x1.5) at most half of it, never below
        # the idle interval.
        stall = rt.config.liveness_stall_intervals * rt.config.interval
        cap = max(rt.config.interval, min(300.0, stall / 3)) if stall > 0 else 300.0

        async def one_pass() -> float:
            nonlocal failures, calls_failed
            try:
                result = await run(body, namespace, kw)
            except kopf.PermanentError as e:
                logger.debug("Pass of %s/%s ended: %s", namespace, body.metadata.name, e)
                return rt.config.interval  # the status says why; a change wakes the loop
            except kopf.TemporaryError as e:  # API errors: exponential backoff with jitter
                failures += 1
                logger.debug("Pass of %s/%s failed (%d): %s", namespace, body.metadata.name,
                             failures, e)  # fmt: skip
                return backoff_delay(failures, rt.config.interval, cap)
            failures = 0
            if result.calls_failed:
                # A write or agent call failed inside the pass (429, 500, an agent refusing):
                # back off exponentially from the poll interval, not retry at it forever; capped
                # at the idle interval, so the loop still passes as often as liveness expects.
                calls_failed += 1
                return max(
                    result.delay,
                    backoff_delay(calls_failed, rt.config.poll_interval, rt.config.interval),
                )
            calls_failed = 0
            return result.delay

        ns, name = namespace or "", str(body.metadata.name)
        try:
            await drive(one_pass, rt.wakeups.register(ns, name), stopped.is_set)
        finally:
            rt.wakeups.unregister(ns, name)

    @kopf.on.event("pods", id="wake", registry=registry)
    async def wake_loops(body: kopf.Body, namespace: str | None, **kw: Any) -> None:
        rt.wakeups.wake(namespace or "")  # async: on the loop's thread
        # every event, the initial listing too: rebuilds the left-drained series after a restart
        rt.reconciler.note_left_drained(body, deleted=kw.get("type") == "DELETED")

    @kopf.on.delete(GROUP, VERSION, PLURAL, id="release", registry=registry)
    async def release_on_delete(body: kopf.Body, namespace: str | None, **kw: Any) -> None:
        def pods() -> Iterable[Mapping[str, Any]]:  # read once the WeightUpdate's lock is held
            return _of(kw["pods_by_namespace"], namespace)

        try:  # the finalizer stays until every owned pod is released
            await rt.reconciler.finalize(body, pods)
        except WeightrollError as e:
            raise kopf.TemporaryError(str(e), delay=retry_in(kw)) from e
        if rt.config.admit_unmanaged_pods:
            peers = _of(kw["updates_by_namespace"], namespace)
            await rt.reconciler.admit_all(pods(), peers, gone=body.metadata.name)

    def unadmitted(body: kopf.Body, **kw: Any) -> bool:
        enabled, gone = rt.config.admit_unmanaged_pods, kw.get("type") == "DELETED"
        return enabled and not gone and awaits_admission(body)

    # A failed write is not retried here: the pod stays NotReady and its next event decides again.
    @kopf.on.event("pods", id="admit", registry=registry, when=unadmitted)
    async def admit_pod(body: kopf.Body, namespace: str | None, **kw: Any) -> None:
        await rt.reconciler.admit(body, _of(kw["updates_by_namespace"], namespace))

    # A stall raises PermanentError: kopf's /healthz then answers 500 and the kubelet restarts us.
    @kopf.on.probe(id="lastPassAgeSeconds", registry=registry)
    def liveness(**kw: Any) -> float:
        updates: kopf.Index[str, Any] = kw["updates_by_namespace"]
        # A WeightUpdate being deleted has no pass loop (kopf stops its daemon): a deletion
        # waiting on an agent is not a stall, and restarting the operator would not help it.
        active = any(
            not (wu.get("metadata") or {}).get("deletionTimestamp")
            for ns in updates
            for wu in updates.get(ns, [])
        )
        try:
            return rt.liveness.check(active=active, now=time.monotonic())
        except Stalled as e:
            raise kopf.PermanentError(str(e)) from e
