"""Async client of the pod sidecar's HTTP API (``engine_agent.protocol``; docs/contracts.md).

Every ``/v1`` call sends ``Authorization: Bearer <token>`` when the spec names a token Secret.

With a CA bundle (``ca_file``) every call is HTTPS and the agent's certificate must chain to that
CA and carry the server name ``server_name`` (``{namespace}`` is the pod's namespace, so a
certificate issued to one namespace's agents is refused for another's). There is no fallback to
plain HTTP: the token is never sent to an agent that did not prove its identity. The CA file is
re-read when it changes (a rotated CA).
Redirects are never followed (a 3xx is :class:`AgentRejected`), and nothing an agent answers
reaches status, Events or logs except bounded one-line reasons of our own error and status
schemas (:func:`safe_text`); exceptions are described from our side, never by ``repr`` (which
carries the request headers, the bearer token among them).
HTTP answers map to :mod:`weightroll_operator.errors` classes by status code; a connection error,
a timeout or a 5xx is :class:`AgentUnavailable` (the agent may come back), a 4xx is
:class:`AgentRejected` or one of its subclasses.
"""

from __future__ import annotations

import json
import logging
import os
import re
import ssl
from typing import Any, Final, TypeVar
from urllib.parse import quote

import aiohttp
from pydantic import ValidationError

from engine_agent.protocol import (
    UPDATE_ID_PATTERN,
    VERSION_PATTERN,
    AgentState,
    ErrorBody,
    UpdateRequest,
    UpdateStatus,
)
from weightroll_operator.errors import (
    AgentConflict,
    AgentError,
    AgentNotFound,
    AgentRejected,
    AgentUnauthorized,
    AgentUnavailable,
)
from weightroll_operator.ports import AgentTarget

__all__ = ["DEFAULT_SERVER_NAME", "MAX_ANSWER_BYTES", "AgentClient", "safe_text"]

#: The name an agent's certificate must carry (``{namespace}``: the pod's namespace).
DEFAULT_SERVER_NAME: Final = "weightroll-agent.{namespace}.svc"
#: The largest answer read from an agent; a larger one is not parsed (a status has ~1 KiB a rank).
MAX_ANSWER_BYTES: Final = 4 << 20
#: Bounds of what an agent's answer may put into status, Events and logs.
MAX_REASON_CHARS: Final = 200
MAX_REASONS: Final = 8

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
            async with session.request(
                method, url, json=body, headers=headers, allow_redirects=False, **extra
            ) as resp:
                status = resp.status
                if 300 <= status < 400:
                    # Never followed: the token and the answer would belong to whatever
                    # Location names (a cloud metadata service, another pod).
                    raise AgentRejected(
                        f"{target.pod}: {method} {path} -> {status}: a redirect, not followed",
                        status=status,
                    )
                data = _json_or_none(await resp.content.read(MAX_ANSWER_BYTES + 1))
        except (aiohttp.ClientError, TimeoutError, OSError, ssl.SSLError) as e:
            raise AgentUnavailable(f"{target.pod}: {method} {path}: {_describe(e)}") from e
        if status < 400:
            return status, data
        raise _error(target, method, path, status, data)

    async def state(self, target: AgentTarget) -> AgentState:
        _, data = await self._call(target, "GET", "/v1/state")
        return _parse(AgentState, data, target)

    async def get_update(self, target: AgentTarget, update_id: str) -> UpdateStatus | None:
        """The update's status, or ``None`` when the agent does not know the id (404)."""
        try:
            _, data = await self._call(target, "GET", f"/v1/updates/{_update_segment(update_id)}")
        except AgentNotFound:
            return None
        return _parse(UpdateStatus, data, target)

    async def start_update(self, target: AgentTarget, request: UpdateRequest) -> None:
        """``POST /v1/updates`` (idempotent by id on the agent)."""
        await self._call(target, "POST", "/v1/updates", request.to_wire())

    async def swap_update(self, target: AgentTarget, update_id: str) -> None:
        """``POST /v1/updates/{id}/swap``: the go for an update parked in ``Prefetched``
        (idempotent once given on the agent)."""
        await self._call(target, "POST", f"/v1/updates/{_update_segment(update_id)}/swap")

    async def abort_update(self, target: AgentTarget, update_id: str) -> None:
        try:
            await self._call(target, "POST", f"/v1/updates/{_update_segment(update_id)}/abort")
        except AgentNotFound:
            return


_M = TypeVar("_M", AgentState, UpdateStatus)
_UPDATE_ID_RE = re.compile(UPDATE_ID_PATTERN)


def _update_segment(update_id: str) -> str:
    """An update id as one URL path segment; ``ValueError`` for anything else (no request)."""
    if not _UPDATE_ID_RE.fullmatch(update_id):
        raise ValueError(f"not an update id: {update_id[:80]!r}")
    return quote(update_id, safe="")


def _json_or_none(raw: bytes) -> Any:
    """The answer's JSON, or ``None`` when it is not JSON, too deep or too large to keep."""
    if len(raw) > MAX_ANSWER_BYTES:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # ValueError covers decode errors and huge integers
        return None


def _describe(e: BaseException) -> str:
    """What went wrong with a call, from our side only.

    Never ``repr(e)``: aiohttp's response errors carry the request (with its ``Authorization``
    header) and the answer's reason phrase and URL, which the agent chooses.
    """
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return "timed out"
    os_error = getattr(e, "os_error", None) or (e if isinstance(e, OSError) else None)
    if isinstance(os_error, ssl.SSLCertVerificationError):
        return f"TLS: {safe_text(os_error.verify_message or 'certificate refused', 120)}"
    if isinstance(os_error, OSError) and os_error.strerror:
        return f"{type(e).__name__}: {safe_text(os_error.strerror, 120)}"
    return type(e).__name__


def safe_text(text: str, limit: int = MAX_REASON_CHARS, *, secret: str | None = None) -> str:
    """``text`` as one bounded line: control characters replaced, at most ``limit`` characters,
    ``secret`` (the token sent with the call) masked wherever an agent echoed it.

    Everything an agent says that the operator repeats (status, Events, logs) goes through this:
    an agent is a pod that anyone able to create pods in the namespace can impersonate.
    """
    if secret:
        text = text.replace(secret, "***")
    line = "".join(c if c.isprintable() else " " for c in text[: limit + 1]).strip()
    return line if len(line) <= limit else line[: limit - 1] + "\u2026"


def _parse(model: type[_M], data: Any, target: AgentTarget) -> _M:
    try:
        parsed = model.model_validate(data)
    except ValidationError as e:
        # Where the answer is wrong, never what it says (pydantic quotes the input values).
        where = ", ".join(
            ".".join(str(p) for p in err["loc"]) or "(body)" for err in e.errors()[:5]
        )
        problem = f"unreadable {model.__name__} ({e.error_count()} errors at {safe_text(where)})"
        raise AgentRejected(f"{target.pod}: {problem}") from None
    for where, value, pattern in _names(parsed):
        # Versions and ids reach status and pod labels verbatim: only our grammar is taken.
        if value and not pattern.fullmatch(value):
            raise AgentRejected(f"{target.pod}: unreadable {model.__name__} (invalid {where})")
    return _bounded(parsed, target.token)


_VERSION_RE = re.compile(VERSION_PATTERN)


_Name = tuple[str, str | None, re.Pattern[str]]


def _names(answer: AgentState | UpdateStatus) -> list[_Name]:
    """The versions and update ids of an answer, each with the grammar it must follow."""
    v, u = _VERSION_RE, _UPDATE_ID_RE
    names: list[_Name]
    if isinstance(answer, UpdateStatus):
        names = [("id", answer.id, u), ("version", answer.version, v)]
        ranks = [(r.version, r.update_id) for r in answer.ranks]
    else:
        names = [
            ("version", answer.version, v),
            ("committedVersion", answer.committed_version, v),
            ("activeUpdateId", answer.active_update_id, u),
            ("committedUpdateId", answer.committed_update_id, u),
        ]
        ranks = [(r.version, r.update_id) for r in answer.ranks]
    for version, update_id in ranks:
        names += [("ranks[].version", version, v), ("ranks[].updateId", update_id, u)]
    return names


def _bounded(answer: _M, token: str | None) -> _M:
    """``answer`` with every free text that may be repeated bounded (:func:`safe_text`)."""
    message = safe_text(answer.message, secret=token)
    if isinstance(answer, UpdateStatus):
        verdict = answer.verdict
        if verdict is not None:
            reasons = [safe_text(r, secret=token) for r in verdict.reasons[:MAX_REASONS]]
            verdict = verdict.model_copy(update={"reasons": reasons})
        return answer.model_copy(update={"message": message, "verdict": verdict})
    return answer.model_copy(update={"message": message})


def _error(target: AgentTarget, method: str, path: str, status: int, data: Any) -> AgentError:
    body: ErrorBody | None = None
    if isinstance(data, dict):
        raw = data.get("error", data)
        try:
            body = ErrorBody.model_validate(raw)
        except ValidationError:
            body = None
    # Only a reason in our own error schema is repeated, bounded; any other body is not.
    token = target.token
    detail = "no error in the agent's schema"
    if body is not None:
        detail = safe_text(body.message, secret=token)
    message = f"{target.pod}: {method} {path} -> {status}: {detail}"
    field = safe_text(body.field, 120, secret=token) if body is not None and body.field else None
    if status == 401:
        return AgentUnauthorized(message, status=status)
    if status == 404:
        return AgentNotFound(message, status=status)
    if status == 409:
        active = None
        if isinstance(data, dict):
            active = data.get("activeId") or data.get("active_id")
        if not (isinstance(active, str) and _UPDATE_ID_RE.fullmatch(active)):
            active = None
        return AgentConflict(message, status=status, active_id=active)
    if 400 <= status < 500:
        return AgentRejected(message, status=status, field=field)
    return AgentUnavailable(message, status=status)
