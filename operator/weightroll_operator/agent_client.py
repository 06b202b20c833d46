"""Async client of the pod sidecar's HTTP API (``engine_agent.protocol``; docs/contracts.md).

Every ``/v1`` call sends ``Authorization: Bearer <token>`` when the spec names a token Secret.

With a CA bundle (``ca_file``) every call is HTTPS and the agent's certificate must chain to that
CA and carry the server name ``server_name`` (``{namespace}`` is the pod's namespace, so a
certificate issued to one namespace's agents is refused for another's). There is no fallback to
plain HTTP: the token is never sent to an agent that did not prove its identity. The CA file is
re-read when it changes (a rotated CA).
HTTP answers map to :mod:`weightroll_operator.errors` classes by status code; a connection error,
a timeout or a 5xx is :class:`AgentUnavailable` (the agent may come back), a 4xx is
:class:`AgentRejected` or one of its subclasses.
"""

from __future__ import annotations

import logging
import os
import ssl
from typing import Any, Final, TypeVar

import aiohttp
from pydantic import ValidationError

from engine_agent.protocol import AgentState, ErrorBody, UpdateRequest, UpdateStatus
from weightroll_operator.errors import (
    AgentConflict,
    AgentError,
    AgentNotFound,
    AgentRejected,
    AgentUnauthorized,
    AgentUnavailable,
)
from weightroll_operator.ports import AgentTarget

__all__ = ["DEFAULT_SERVER_NAME", "AgentClient"]

#: The name an agent's certificate must carry (``{namespace}``: the pod's namespace).
DEFAULT_SERVER_NAME: Final = "weightroll-agent.{namespace}.svc"

log = logging.getLogger(__name__)


class AgentClient:
    """One aiohttp session shared by all agent calls of the operator.

    Args:
        timeout: seconds per call (connect + read). Agents answer fast; the update itself runs
            in the background and is polled.
        concurrency: open connections at most.
    """

    def __init__(
        self,
        *,
        timeout: float = 5.0,
        concurrency: int = 64,
        ca_file: str | None = None,
        server_name: str = DEFAULT_SERVER_NAME,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._limit = concurrency
        self._session: aiohttp.ClientSession | None = None
        self._ca_file = ca_file or None
        self._server_name = server_name
        self._ssl: tuple[float, ssl.SSLContext] | None = None

    def _tls(self) -> ssl.SSLContext:
        """The verifying client context, rebuilt when the CA file changes."""
        assert self._ca_file is not None
        stamp = os.stat(self._ca_file).st_mtime
        if self._ssl is None or self._ssl[0] != stamp:
            ctx = ssl.create_default_context(cafile=self._ca_file)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            self._ssl = (stamp, ctx)
        return self._ssl[1]

    async def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(limit=self._limit, force_close=False),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self, target: AgentTarget, method: str, path: str, body: Any = None
    ) -> tuple[int, Any]:
        session = await self._sess()
        headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}
        url = target.base_url.rstrip("/") + path
        extra: dict[str, Any] = {}
        try:
            if self._ca_file is not None:
                url = "https://" + url.removeprefix("http://").removeprefix("https://")
                extra = {
                    "ssl": self._tls(),
                    "server_hostname": self._server_name.format(namespace=target.namespace),
                }
            async with session.request(method, url, json=body, headers=headers, **extra) as resp:
                try:
                    data: Any = await resp.json(content_type=None)
                except ValueError:
                    data = None
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError, ssl.SSLError) as e:
            raise AgentUnavailable(f"{target.pod}: {method} {path}: {e!r}") from e
        if status < 400:
            return status, data
        raise _error(target, method, path, status, data)

    async def state(self, target: AgentTarget) -> AgentState:
        _, data = await self._call(target, "GET", "/v1/state")
        return _parse(AgentState, data, target)

    async def get_update(self, target: AgentTarget, update_id: str) -> UpdateStatus | None:
        """The update's status, or ``None`` when the agent does not know the id (404)."""
        try:
            _, data = await self._call(target, "GET", f"/v1/updates/{update_id}")
        except AgentNotFound:
            return None
        return _parse(UpdateStatus, data, target)

    async def start_update(self, target: AgentTarget, request: UpdateRequest) -> None:
        """``POST /v1/updates`` (idempotent by id on the agent)."""
        await self._call(target, "POST", "/v1/updates", request.to_wire())

    async def abort_update(self, target: AgentTarget, update_id: str) -> None:
        try:
            await self._call(target, "POST", f"/v1/updates/{update_id}/abort")
        except AgentNotFound:
            return


_M = TypeVar("_M", AgentState, UpdateStatus)


def _parse(model: type[_M], data: Any, target: AgentTarget) -> _M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise AgentRejected(f"{target.pod}: unreadable {model.__name__}: {e}") from e


def _error(target: AgentTarget, method: str, path: str, status: int, data: Any) -> AgentError:
    body: ErrorBody | None = None
    if isinstance(data, dict):
        raw = data.get("error", data)
        try:
            body = ErrorBody.model_validate(raw)
        except ValidationError:
            body = None
    detail = body.message if body is not None else str(data)[:200]
    message = f"{target.pod}: {method} {path} -> {status}: {detail}"
    field = body.field if body is not None else None
    if status == 401:
        return AgentUnauthorized(message, status=status)
    if status == 404:
        return AgentNotFound(message, status=status)
    if status == 409:
        active = None
        if isinstance(data, dict):
            active = data.get("activeId") or data.get("active_id")
        return AgentConflict(message, status=status, active_id=active)
    if 400 <= status < 500:
        return AgentRejected(message, status=status, field=field)
    return AgentUnavailable(message, status=status)
