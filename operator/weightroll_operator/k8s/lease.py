"""Leader election on a ``coordination.k8s.io/v1`` Lease (issue 11 finding 6, HA).

The chart runs two operator replicas; only the holder of the Lease runs kopf (watches, passes,
writes). The other waits, serving only its liveness and the admission webhook, and takes over
when the holder stops renewing: on a crash or a kill after ``lease_seconds``, on a clean shutdown
at once (the holder gives the Lease up).

Rules (as client-go's ``leaderelection``):
    * Every write of the Lease is a PUT conditional on the ``resourceVersion`` read, so two
      candidates never both take it.
    * Expiry is judged by the *local* monotonic clock: a Lease is free when its record has not
      changed for ``leaseDurationSeconds`` since this candidate first saw that record, whatever
      the holder's clock says (no clock-skew assumption).
    * A holder that could not renew for ``renew_deadline`` seconds (< ``lease_seconds``) stops
      acting: :meth:`LeaderElector.hold` returns and the operator exits, before any other
      candidate may take the Lease.

A holder's own writes are fenced locally (issue 27 item 12): :meth:`LeaderElector.acting_for`
says how long it may still write, and the API client (``KubeApi.fence``) refuses every write
but the Lease's own once that reaches zero, and bounds each write's timeout by it. So the old
leader's last write is sent before ``renew_deadline`` ends, not whenever kopf's shutdown gets to
it (it used to write status up to 3.5 s past the Lease, with a 5 s margin). The deadline counts
from the *start* of the last successful renewal, which is before the standby first sees the
renewed record, so the margin to a takeover is at least ``lease_seconds - renew_deadline``.

This is still not server-side fencing: a write sent just before the deadline may land after it,
within its (bounded) timeout. The writes themselves are conditional on the ``resourceVersion``
of what they read (``apply.py``), so such a late write is refused when anyone else wrote the pod
since, and never overwrites the new leader's work.

Works on Kubernetes >= 1.14 (``coordination.k8s.io/v1``), so on the 1.20 test apiserver.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from weightroll_operator.errors import KubeConflict, KubeError, KubeNotFound

__all__ = ["LeaderElector", "LeaseApi"]

log = logging.getLogger(__name__)


class LeaseApi(Protocol):
    """The three Lease calls (``k8s.client.KubeApi`` implements them)."""

    async def get_lease(self, namespace: str, name: str) -> Any: ...

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> Any: ...

    async def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> Any: ...


def _micro_time(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaderElector:
    """Acquire, renew and release one Lease for ``identity``.

    Args:
        api: the Lease calls.
        namespace: namespace of the Lease (the operator's own).
        name: name of the Lease.
        identity: this candidate (the pod name); must differ between replicas.
        lease_seconds: how long a Lease stays taken without renewal.
        renew_seconds: how often the holder renews (and a candidate retries).
        renew_deadline: how long the holder keeps acting without a successful renewal.
    """

    api: LeaseApi
    namespace: str
    name: str
    identity: str
    lease_seconds: float = 15.0
    renew_seconds: float = 2.0
    renew_deadline: float = 10.0
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], datetime] = field(default=lambda: datetime.now(tz=UTC))
    #: The last record seen (holder, renewTime, transitions) and when it was first seen.
    _observed: tuple[Any, float] | None = None
    _last_renew: float = 0.0
    #: :meth:`hold` gave up (or :meth:`release` ran): no more writes, whatever the clock says.
    _stopped: bool = False

    def _spec(self, old: dict[str, Any] | None) -> dict[str, Any]:
        now = _micro_time(self.wall())
        old = old or {}
        taking = old.get("holderIdentity") != self.identity
        transitions = int(old.get("leaseTransitions") or 0) + (1 if taking and old else 0)
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_seconds),
            "acquireTime": now if taking else old.get("acquireTime", now),
            "renewTime": now,
            "leaseTransitions": transitions,
        }

    def _body(self, spec: dict[str, Any], resource_version: str | None) -> dict[str, Any]:
        """The Lease object; a PUT of it is conditional on ``resource_version``."""
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": spec,
        }

    async def try_acquire(self) -> bool:
        """One attempt to take or renew the Lease; whether this candidate holds it now."""
        # A successful renewal counts from here: the standby sees the renewed record later.
        attempt = self.clock()
        try:
            lease = await self.api.get_lease(self.namespace, self.name)
        except KubeNotFound:
            body = self._body(self._spec(None), None)
            try:
                await self.api.create_lease(self.namespace, body)
            except KubeConflict:
                return False  # another candidate created it first
            self._last_renew = attempt
            return True
        spec = dict(lease.get("spec") or {})
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseTransitions"))
        now = self.clock()
        if self._observed is None or self._observed[0] != record:
            self._observed = (record, now)
        holder = spec.get("holderIdentity")
        duration = float(spec.get("leaseDurationSeconds") or self.lease_seconds)
        free = not holder or now - self._observed[1] >= duration
        if holder != self.identity and not free:
            return False
        body = self._body(self._spec(spec), (lease.get("metadata") or {}).get("resourceVersion"))
        try:
            await self.api.replace_lease(self.namespace, self.name, body)
        except KubeConflict:
            return False  # someone wrote it since we read it: look again next time
        if holder != self.identity:
            log.info("Took the leader Lease %s/%s from %r", self.namespace, self.name, holder)
        self._last_renew = attempt
        return True

    async def acquire(self) -> None:
        """Wait until this candidate holds the Lease."""
        log.info("Waiting for the leader Lease %s/%s as %s", self.namespace, self.name,
                 self.identity)  # fmt: skip
        while True:
            try:
                if await self.try_acquire():
                    log.info("Acquired the leader Lease %s/%s", self.namespace, self.name)
                    return
            except KubeError as e:
                log.warning("Failed to read the leader Lease: %s", e)
            await asyncio.sleep(self.renew_seconds)

    async def hold(self) -> None:
        """Renew the Lease until a renewal has failed for ``renew_deadline``; then return."""
        while True:
            await asyncio.sleep(self.renew_seconds)
            try:
                # Bounded by what is left of the deadline: on a slow API server a renewal that
                # answers late would let this replica act after a standby took the Lease.
                held = await asyncio.wait_for(self.try_acquire(), self._left())
            except (KubeError, TimeoutError) as e:
                log.warning("Failed to renew the leader Lease: %s", e or "timed out")
                held = False
            if not held and self._left() <= 0:
                log.error("Lost the leader Lease %s/%s: stopping", self.namespace, self.name)
                self._stopped = True
                return
            if not held:
                try:
                    lease = await asyncio.wait_for(
                        self.api.get_lease(self.namespace, self.name), self._left()
                    )
                except (KubeError, TimeoutError):
                    continue
                if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    log.error("Another replica holds the leader Lease: stopping")
                    self._stopped = True
                    return

    def _left(self) -> float:
        """Seconds left before a holder that could not renew must stop."""
        return max(0.0, self.renew_deadline - (self.clock() - self._last_renew))

    def acting_for(self) -> float:
        """Seconds this replica may still write (0: it must not): the write fence
        (``KubeApi.fence``). Zero before the first acquisition and after :meth:`hold` gave up."""
        if self._stopped or not self._last_renew:
            return 0.0
        return self._left()

    async def release(self) -> None:
        """Give the Lease up (clean shutdown), so a standby takes over at once."""
        self._stopped = True
        try:
            lease = await self.api.get_lease(self.namespace, self.name)
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return
            spec["holderIdentity"] = ""
            spec["renewTime"] = _micro_time(self.wall())
            body = self._body(spec, (lease.get("metadata") or {}).get("resourceVersion"))
            await self.api.replace_lease(self.namespace, self.name, body)
            log.info("Released the leader Lease %s/%s", self.namespace, self.name)
        except KubeError as e:
            log.warning("Failed to release the leader Lease: %s", e)
