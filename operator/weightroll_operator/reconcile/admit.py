"""Admission: the gate of a pod no WeightUpdate governs, set True on its boot weights.

Pods no WeightUpdate selects are handled apart from the passes, one pod event at a time; the
rule is :func:`~weightroll_operator.domain.admission.decide`. Never raises for the API: the pod
stays NotReady (fail closed) until its next watch event decides again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from weightroll_operator.apply import write_gate
from weightroll_operator.domain import admission
from weightroll_operator.errors import KubeConflict, KubeError, KubeNotFound
from weightroll_operator.metrics import Metrics
from weightroll_operator.ports import KubePort

__all__ = ["Admitter"]

log = logging.getLogger("weightroll_operator.reconcile")


@dataclass
class Admitter:
    """Admits pods (through ``kube``), counting them in ``metrics``."""

    kube: KubePort
    clock: Callable[[], datetime]
    metrics: Metrics | None = None

    async def admit(self, pod: Mapping[str, Any], peers: Iterable[Mapping[str, Any]]) -> bool:
        """Set the gate of ``pod`` True on its boot weights if no WeightUpdate governs it.

        ``peers`` are the WeightUpdates of the pod's namespace. The write is conditional on
        the pod's ``resourceVersion`` (when it has one), so a WeightUpdate that claimed or
        drained the pod since this event was observed always wins.

        Never raises for the API: a vanished pod (404) is not an error; a conflict (409) means
        the pod changed, and that change's watch event decides again; any other error is logged
        and the pod stays NotReady (fail closed) until its next watch event retries.

        Returns:
            Whether the gate was written.
        """
        decision = admission.decide(pod, peers)
        meta = pod.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        if not decision.admit:
            log.debug("Not admitting Pod %s/%s: %s", namespace, name, decision.message)
            return False
        try:
            await write_gate(
                self.kube,
                namespace,
                name,
                True,
                admission.AdmissionReason.ADMITTED,
                "Serving its boot weights: no WeightUpdate selects it",
                self.clock(),
                resource_version=meta.get("resourceVersion"),
            )
        except KubeNotFound:
            log.info("Skipped admission of Pod %s/%s: the pod is gone", namespace, name)
            return False
        except KubeConflict:
            log.info("Deferred admission of Pod %s/%s: the pod changed", namespace, name)
            return False
        except KubeError as e:
            log.warning("Failed to admit Pod %s/%s, it stays NotReady: %s", namespace, name, e)
            return False
        log.info(
            "Admitted Pod %s/%s serving its boot weights: no WeightUpdate selects it",
            namespace,
            name,
        )
        if self.metrics is not None:
            self.metrics.observe_admitted(namespace)
        return True

    async def admit_all(
        self,
        pods: Iterable[Mapping[str, Any]],
        peers: Iterable[Mapping[str, Any]],
        *,
        gone: str | None = None,
    ) -> int:
        """:meth:`admit` every pod of ``pods`` that awaits admission; return how many were.

        For the moment the WeightUpdate named ``gone`` is deleted (it is left out of ``peers``):
        the pods it selected but never touched get no watch event of their own.
        """
        peers = [p for p in peers if (p.get("metadata") or {}).get("name") != gone]
        count = 0
        for pod in pods:
            if admission.awaits_admission(pod):
                count += await self.admit(pod, peers)
        return count
