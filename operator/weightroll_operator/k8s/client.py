"""A small async Kubernetes REST client: exactly the calls the operator makes, nothing else.

Why not kopf's ``patch``: kopf sends JSON merge patches, which replace the whole
``status.conditions`` list of a pod and would drop ``Ready`` (operator.md §2.2). Pod conditions go
through :meth:`KubeApi.patch_pod_condition` as a *strategic merge* patch on ``pods/status``, so
they merge by ``type`` and only ``weightroll.io/weights-ready`` is ever written.

Invariants:
    * The operator never writes the pod ``Ready`` condition (:meth:`patch_pod_condition` refuses).
    * Every write is a patch, never a PUT with a stale resourceVersion (kruise#2276). Pod writes
      may carry a ``resourceVersion`` precondition (the API server answers 409, ``KubeConflict``,
      when the pod changed since it was read) and return the version they produced, so a chain
      of writes on one pod stays conditional from the observation to the last write (issue 11
      finding 6: two WeightUpdates, or two operator replicas, never both claim a pod).
    * ``writes`` counts every write by kind, for the benchmark and the tests.
    * A token file (the projected ServiceAccount token in a pod) is re-read whenever it changes:
      kubelet rotates bound tokens by swapping the file, and the next request sends the new one.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import aiohttp

from weightroll_operator.api.names import check_secret_key, path_segment
from weightroll_operator.api.v1alpha1 import GROUP, PLURAL, VERSION
from weightroll_operator.domain.model import CONDITION_WEIGHTS_READY, LABEL_AGENT_TOKEN
from weightroll_operator.errors import InvalidSpec, KubeUnavailable, kube_error

__all__ = ["KubeApi", "KubeConfig"]

log = logging.getLogger(__name__)

SMP = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


#: The Lease API: the elector's own writes are never fenced.
_LEASES = "/apis/coordination.k8s.io/"


@dataclass(frozen=True, slots=True)
class KubeConfig:
    """Where the API server is and how to authenticate (the token is never logged)."""

    server: str
    token: str | None = None
    #: File holding the bearer token, re-read when it changes (wins over ``token``).
    token_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True

    def __repr__(self) -> str:
        return f"KubeConfig(server={self.server!r})"

    @classmethod
    def load(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeConfig:
        """In-cluster service account if present, else the kubeconfig (``$KUBECONFIG``)."""
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            host = os.environ["KUBERNETES_SERVICE_HOST"]
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            host = f"[{host}]" if ":" in host else host
            return cls(
                server=f"https://{host}:{port}",
                token_file=str(_SA_DIR / "token"),
                ca_file=str(_SA_DIR / "ca.crt"),
            )
        from kubernetes import client, config  # deferred: only needed for kubeconfig parsing

        cfg = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=cfg
        )
        auth = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
        token = auth.removeprefix("Bearer ").strip() if auth else None
        return cls(
            server=str(cfg.host).rstrip("/"),
            token=token,
            ca_file=cfg.ssl_ca_cert,
            cert_file=cfg.cert_file,
            key_file=cfg.key_file,
            verify=bool(cfg.verify_ssl),
        )


class KubeApi:
    """The operator's Kubernetes calls over one aiohttp session.

    Args:
        config: server and credentials.
        timeout: seconds per request.
    """

    def __init__(self, config: KubeConfig, *, timeout: float = 10.0) -> None:
        self.config = config
        self.writes: Counter[str] = Counter()
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._event_seq = itertools.count()
        self._token_stamp: tuple[int, int, int] | None = None
        self._token = config.token
        #: The API server's clock at its last answer (the ``Date`` header), ``None`` before one.
        #: ``weightroll abort|retry`` stamp the status with it: the operator compares those
        #: stamps with its own times, and the CLI machine's clock may be far off (issue 27).
        self.server_date: datetime | None = None
        #: Seconds this process may still write (the leader's write fence,
        #: ``LeaderElector.acting_for``); ``None``: no leader election, always. Once it reaches
        #: zero every write but the Lease's own is refused unsent, and a write's timeout never
        #: outlasts it (issue 27 item 12: an old leader wrote status after losing the Lease).
        self.fence: Callable[[], float] | None = None

    def current_token(self) -> str | None:
        """The bearer token to send now: the token file's content, re-read when its inode, size
        or mtime changed (kubelet replaces a projected token atomically), else ``config.token``.

        An unreadable file keeps the last token (logged); the API answers 401 if it expired.
        """
        path = self.config.token_file
        if path is None:
            return self._token
        try:
            st = os.stat(path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
            if stamp != self._token_stamp:
                self._token = Path(path).read_text().strip() or None
                self._token_stamp = stamp
        except OSError as e:
            log.error("Kept the previous API token: cannot read %s: %s", path, e)
        return self._token

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.config.server.startswith("https"):
            return False
        if not self.config.verify:
            return False
        ctx = ssl.create_default_context(cafile=self.config.ca_file)
        if self.config.cert_file and self.config.key_file:
            ctx.load_cert_chain(self.config.cert_file, self.config.key_file)
        return ctx

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json"}
            self._session = aiohttp.ClientSession(
                base_url=self.config.server,
                headers=headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=self._ssl(), limit=64),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        content_type: str = "application/json",
        params: Mapping[str, str] | None = None,
        kind: str | None = None,
    ) -> Any:
        timeout = self._fenced(method, path)
        session = await self._sess()
        if kind is not None:
            self.writes[kind] += 1
        headers = {"Content-Type": content_type} if body is not None else {}
        token = self.current_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with session.request(
                method,
                path,
                json=body,
                headers=headers,
                params=params,
                allow_redirects=False,
                timeout=timeout,
            ) as resp:
                self._note_date(resp.headers.get("Date"))
                if 300 <= resp.status < 400:
                    # Never followed: the token would go to wherever Location points.
                    raise KubeUnavailable(resp.status, f"{method} {path}: redirect not followed")
                text = await resp.text() if resp.content_length != 0 else ""
                try:
                    data: Any = json.loads(text) if text else None
                except json.JSONDecodeError:
                    # A proxy or load balancer answered with HTML or plain text.
                    data = {"message": text[:200]}
                    if resp.status < 400:
                        raise KubeUnavailable(
                            resp.status, f"{method} {path}: not a Kubernetes API response"
                        ) from None
                if resp.status >= 400:
                    message = data.get("message", resp.reason) if isinstance(data, dict) else ""
                    raise kube_error(resp.status, f"{method} {path}: {message}", data)
                return data
        except (aiohttp.ClientConnectionError, TimeoutError) as e:
            raise KubeUnavailable(0, f"{method} {path}: {e!r}") from e

    def _fenced(self, method: str, path: str) -> aiohttp.ClientTimeout | None:
        """The timeout of this request under the write fence (``None``: the session's).

        Raises:
            KubeUnavailable: a write once the fence is down (not sent).
        """
        if self.fence is None or method in ("GET", "HEAD") or path.startswith(_LEASES):
            return None
        left = self.fence()
        if left <= 0:
            raise KubeUnavailable(
                0, f"{method} {path}: not sent: this replica no longer holds the leader Lease"
            )
        total = self._timeout.total
        return aiohttp.ClientTimeout(total=left if total is None else min(total, left))

    def _note_date(self, header: str | None) -> None:
        if not header:
            return
        try:
            when = parsedate_to_datetime(header)
        except (TypeError, ValueError):
            return  # a proxy's odd header: keep the last good one
        if when.tzinfo is not None:
            self.server_date = when.astimezone(UTC)

    # ---- pods ---------------------------------------------------------------------------------

    async def list_pods(self, namespace: str, label_selector: str | None = None) -> list[Any]:
        params = {"labelSelector": label_selector} if label_selector else None
        data = await self._call("GET", f"/api/v1/namespaces/{_ns(namespace)}/pods", params=params)
        return list((data or {}).get("items") or [])

    async def find_pod(self, namespace: str, name: str) -> Any:
        """The pod named ``name``, or ``None``: a list narrowed by a field selector (the chart's
        RBAC grants ``list`` on pods, not ``get``)."""
        params = {"fieldSelector": f"metadata.name={_name(name)}"}
        data = await self._call("GET", f"/api/v1/namespaces/{_ns(namespace)}/pods", params=params)
        items = (data or {}).get("items") or []
        return next((p for p in items if (p.get("metadata") or {}).get("name") == name), None)

    async def patch_pod_condition(
        self,
        namespace: str,
        name: str,
        condition: Mapping[str, Any],
        *,
        resource_version: str | None = None,
    ) -> str | None:
        """Strategic-merge one condition into ``pods/status`` (merges by ``type``).

        ``resource_version`` makes the patch conditional: the API server answers 409
        (``KubeConflict``) when the pod changed since that version was read.

        Returns:
            The pod's ``resourceVersion`` after the write (``None`` if the server sent none).
        """
        if condition.get("type") != CONDITION_WEIGHTS_READY:
            raise ValueError(f"the operator writes only {CONDITION_WEIGHTS_READY}")
        body: dict[str, Any] = {"status": {"conditions": [dict(condition)]}}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        data = await self._call(
            "PATCH",
            f"/api/v1/namespaces/{_ns(namespace)}/pods/{_name(name)}/status",
            body=body,
            content_type=SMP,
            kind="pod-status",
        )
        return _resource_version(data)

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        annotations: Mapping[str, str | None] | None = None,
        labels: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> str | None:
        """Merge-patch annotations/labels (``None`` removes a key).

        ``resource_version`` makes the patch conditional (409, ``KubeConflict``, when the pod
        changed since). Returns the pod's ``resourceVersion`` after the write (``None`` when
        nothing was written or the server sent none).
        """
        meta: dict[str, Any] = {}
        if annotations:
            meta["annotations"] = dict(annotations)
        if labels:
            meta["labels"] = dict(labels)
        if not meta:
            return resource_version
        if resource_version is not None:
            meta["resourceVersion"] = resource_version
        data = await self._call(
            "PATCH",
            f"/api/v1/namespaces/{_ns(namespace)}/pods/{_name(name)}",
            body={"metadata": meta},
            content_type=MERGE,
            kind="pod-metadata",
        )
        return _resource_version(data)

    # ---- WeightUpdates ------------------------------------------------------------------------

    def _wu_path(self, namespace: str, name: str | None = None) -> str:
        base = f"/apis/{GROUP}/{VERSION}/namespaces/{_ns(namespace)}/{PLURAL}"
        return base if name is None else f"{base}/{_name(name)}"

    async def get_weightupdate(self, namespace: str, name: str) -> Any:
        return await self._call("GET", self._wu_path(namespace, name))

    async def list_weightupdates(self, namespace: str) -> list[Any]:
        data = await self._call("GET", self._wu_path(namespace))
        return list((data or {}).get("items") or [])

    async def patch_weightupdate_spec(
        self,
        namespace: str,
        name: str,
        spec: Mapping[str, Any],
        *,
        resource_version: str | None = None,
    ) -> Any:
        """JSON-merge-patch ``spec`` fields of a WeightUpdate (the CLI's day-2 verbs).

        The operator itself never writes a spec: this is the user's intent (``spec.paused``,
        ``spec.strategy.pauseAfterCanary``), sent on the user's behalf by ``weightroll``.

        Args:
            namespace: namespace of the WeightUpdate.
            name: its name.
            spec: the fields to merge into ``spec`` (nested objects merge, ``None`` deletes).
            resource_version: when given, the patch applies only to that version of the
                object (the API server answers 409, ``KubeConflict``, if it changed since).

        Returns:
            The WeightUpdate as stored after the patch.

        Raises:
            KubeError: by status code (``KubeNotFound`` for an unknown name).
        """
        body: dict[str, Any] = {"spec": dict(spec)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return await self._call(
            "PATCH", self._wu_path(namespace, name), body=body, content_type=MERGE, kind="wu-spec"
        )

    async def patch_weightupdate_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> None:
        await self._call(
            "PATCH",
            self._wu_path(namespace, name) + "/status",
            body={"status": dict(patch)},
            content_type=MERGE,
            kind="wu-status",
        )

    # ---- leader election (k8s/lease.py) -------------------------------------------------------

    def _lease_path(self, namespace: str, name: str | None = None) -> str:
        base = f"/apis/coordination.k8s.io/v1/namespaces/{_ns(namespace)}/leases"
        return base if name is None else f"{base}/{_name(name)}"

    async def get_lease(self, namespace: str, name: str) -> Any:
        return await self._call("GET", self._lease_path(namespace, name))

    async def create_lease(self, namespace: str, body: dict[str, Any]) -> Any:
        return await self._call("POST", self._lease_path(namespace), body=body, kind="lease")

    async def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> Any:
        """PUT the Lease; conditional on ``body.metadata.resourceVersion`` (409 if stale)."""
        return await self._call("PUT", self._lease_path(namespace, name), body=body, kind="lease")

    # ---- secrets and events -------------------------------------------------------------------

    async def read_agent_token(self, namespace: str, name: str, key: str) -> str:
        """The bearer token to send to agents: the first non-empty line of the Secret's key.

        Only a Secret labelled ``weightroll.io/agent-token: "true"`` is ever sent, so a
        WeightUpdate cannot make the operator forward an arbitrary Secret (confused deputy).
        The other lines are tokens the agents still accept during a rotation.

        Raises:
            InvalidSpec: the Secret lacks the opt-in label or the key is empty (names the field).
            KubeError: by status code (``KubeNotFound`` for a missing Secret or key).
        """
        try:
            check_secret_key(key)
            path = f"/api/v1/namespaces/{_ns(namespace)}/secrets/{_name(name)}"
        except ValueError as e:
            raise InvalidSpec(f"spec.agent.tokenSecretRef: {e}") from None
        data = await self._call("GET", path)
        labels = ((data or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_AGENT_TOKEN) != "true":
            raise InvalidSpec(
                f"spec.agent.tokenSecretRef: Secret {namespace}/{name} does not carry the label "
                f'{LABEL_AGENT_TOKEN}: "true"; only such Secrets are sent to agents'
            )
        raw = ((data or {}).get("data") or {}).get(key)
        if raw is None:
            raise kube_error(404, f"secret {namespace}/{name} has no key {key!r}")
        lines = [t.strip() for t in base64.b64decode(raw).decode().splitlines() if t.strip()]
        if not lines:
            where = f"key {key!r} of Secret {namespace}/{name}"
            raise InvalidSpec(f"spec.agent.tokenSecretRef: {where} is empty")
        return lines[0]

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None:
        """Create an Event; the name is unique per process (kmock lacks ``generateName``)."""
        body = dict(event)
        involved = body.get("involvedObject", {}).get("name", "weightroll")
        stamp = f"{time.time_ns():x}{next(self._event_seq):x}"
        body.setdefault("metadata", {"name": f"{involved}.{stamp}", "namespace": namespace})
        path = f"/api/v1/namespaces/{_ns(namespace)}/events"
        await self._call("POST", path, body=body, kind="event")

    async def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """Merge-patch an Event the operator posted (``count``/``lastTimestamp`` of a repeat).

        Raises:
            KubeNotFound: the Event expired (the API server drops Events after ``--event-ttl``).
        """
        await self._call(
            "PATCH",
            f"/api/v1/namespaces/{_ns(namespace)}/events/{_name(name)}",
            body=dict(patch),
            content_type=MERGE,
            kind="event",
        )

    async def list_events(self, namespace: str, involved_name: str) -> list[Any]:
        params = {"fieldSelector": f"involvedObject.name={involved_name}"}
        path = f"/api/v1/namespaces/{_ns(namespace)}/events"
        data = await self._call("GET", path, params=params)
        items = (data or {}).get("items") or []
        return [e for e in items if (e.get("involvedObject") or {}).get("name") == involved_name]


def _ns(namespace: str) -> str:
    """A namespace as one path segment (``ValueError`` when it is not a namespace name)."""
    return path_segment(namespace, namespace=True)


def _name(name: str) -> str:
    """An object name as one path segment (``ValueError`` when it is not an object name)."""
    return path_segment(name)


def _resource_version(data: Any) -> str | None:
    """The ``metadata.resourceVersion`` of an object the API server returned."""
    meta = data.get("metadata") if isinstance(data, dict) else None
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return str(version) if version else None
