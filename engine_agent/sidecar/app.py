"""HTTP surface of the sidecar (aiohttp): routes, bearer-token auth and error bodies.

Routes (see README.md): ``GET /healthz``, ``GET /readyz``, ``GET /metrics`` (no auth: probes and
Prometheus), and ``GET /v1/state``, ``POST /v1/updates``, ``GET /v1/updates/{id}``,
``POST /v1/updates/{id}/abort`` (bearer token), and vLLM's native weight-transfer routes for
trainers (bearer token; ``transfer_routes.py``).

Invariants:
    * Every ``/v1`` route needs ``Authorization: Bearer <token>``; the token is compared with
      :func:`hmac.compare_digest` and read from a file (a mounted Secret), re-read when the file
      changes so a rotated Secret takes effect without a restart. It is never logged.
    * The file may hold several tokens, one per line, all accepted: a rotation adds the new token
      as a second line, makes it the first (the operator sends the first line), then drops the old
      one, so no request fails while kubelet propagates each step to the pods.
    * Every error is an :class:`~engine_agent.protocol.ErrorBody` JSON: 400 for bodies that are
      not a JSON object, 422 for validation errors (naming the field), 401, 404, 409 (naming the
      active update id in ``field``).
    * Handlers only translate HTTP to :class:`~engine_agent.sidecar.agent.Agent` calls.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from pydantic import ValidationError

from engine_agent.protocol import ErrorBody, UpdateRequest
from engine_agent.sidecar.agent import Agent, UpdateConflict, UpdateNotFound
from engine_agent.sidecar.metrics import CONTENT_TYPE
from engine_agent.sidecar.transfer_routes import add_transfer_routes

__all__ = ["AGENT_KEY", "TokenFile", "create_app"]

logger = logging.getLogger(__name__)

#: Application key under which the :class:`Agent` is stored.
AGENT_KEY: Final = web.AppKey("agent", Agent)
#: Request bodies above this size are refused (an update request is a few hundred bytes).
MAX_BODY_BYTES: Final = 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenFile:
    """Bearer tokens (one per line) read from a file, re-read when its mtime or size changes.

    Raises:
        ValueError: at construction, when the file is missing or empty (the agent must not
            start without a token).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[float, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._load()
        if not self._tokens:
            raise ValueError(f"token file {str(self.path)!r} is empty")

    def _load(self) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp != self._stamp:
                lines = self.path.read_bytes().splitlines()
                self._tokens = tuple(t.strip() for t in lines if t.strip())
                self._stamp = stamp
        except OSError as e:
            if self._stamp is None:
                raise ValueError(f"cannot read token file {str(self.path)!r}: {e}") from e
            logger.error("Kept the previous token: cannot read %s: %s", self.path, e)

    def matches(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the tokens (each compared in constant time)."""
        self._load()
        hits = [hmac.compare_digest(presented, token) for token in self._tokens]
        return bool(presented) and any(hits)


def _error(
    status: int, code: str, message: str, field: str | None = None, **headers: str
) -> web.Response:
    body = ErrorBody(code=code, message=message, field=field).to_wire()
    return web.json_response(body, status=status, headers=headers or None)


def _auth_middleware(tokens: TokenFile) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1"):
            header = request.headers.get("Authorization", "")
            scheme, _, presented = header.partition(" ")
            if scheme.lower() != "bearer" or not tokens.matches(presented.strip().encode()):
                return _error(
                    401,
                    "unauthorized",
                    "missing or wrong bearer token",
                    **{"WWW-Authenticate": 'Bearer realm="weightroll"'},
                )
        return await handler(request)

    return auth


def _validation_error(e: ValidationError) -> web.Response:
    errors = e.errors()
    fields = [".".join(str(part) for part in err["loc"]) for err in errors]
    message = "; ".join(
        f"{where or '<body>'}: {err['msg']}" for where, err in zip(fields, errors, strict=True)
    )
    return _error(422, "invalid_request", message, field=fields[0] if fields else None)


async def _healthz(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _readyz(request: web.Request) -> web.Response:
    readiness = await request.app[AGENT_KEY].readiness()
    body = {"ready": readiness.ready, "reasons": list(readiness.reasons)}
    return web.json_response(body, status=200 if readiness.ready else 503)


async def _metrics(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    await agent.readiness()  # refresh the ready and engine-state gauges
    return web.Response(body=agent.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def _state(request: web.Request) -> web.Response:
    state = await request.app[AGENT_KEY].state()
    return web.json_response(state.to_wire())


async def _post_update(request: web.Request) -> web.Response:
    raw = await request.read()
    try:
        document = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, "malformed_json", f"body is not valid JSON: {e}")
    if not isinstance(document, dict):
        return _error(400, "malformed_json", "body must be a JSON object")
    try:
        update = UpdateRequest.model_validate(document)
    except ValidationError as e:
        return _validation_error(e)
    agent = request.app[AGENT_KEY]
    try:
        created, record = agent.submit(update)
    except UpdateConflict as e:
        body = ErrorBody(code="conflict", message=str(e), field="id", active_id=e.active_id)
        return web.json_response(body.to_wire(), status=409)
    return web.json_response(record.to_status().to_wire(), status=202 if created else 200)


async def _get_update(request: web.Request) -> web.Response:
    update_id = request.match_info["id"]
    try:
        record = request.app[AGENT_KEY].get(update_id)
    except UpdateNotFound:
        return _error(404, "not_found", f"no update with id {update_id!r}", field="id")
    return web.json_response(record.to_status().to_wire())


async def _abort_update(request: web.Request) -> web.Response:
    update_id = request.match_info["id"]
    try:
        record = await request.app[AGENT_KEY].abort(update_id)
    except UpdateNotFound:
        return _error(404, "not_found", f"no update with id {update_id!r}", field="id")
    except UpdateConflict as e:
        return _error(409, "conflict", str(e), field="id")
    # 202 while the update still winds down (ranks finishing a call); poll GET for the end.
    status = 200 if record.phase.terminal else 202
    return web.json_response(record.to_status().to_wire(), status=status)


async def _not_found(request: web.Request) -> web.Response:
    return _error(404, "not_found", f"no route {request.method} {request.path}")


def create_app(agent: Agent, tokens: TokenFile, *, manage_agent: bool = True) -> web.Application:
    """Build the aiohttp application.

    Args:
        agent: the agent the routes drive.
        tokens: the bearer token source for ``/v1``.
        manage_agent: start and stop the agent with the application (tests may do it themselves).
    """
    app = web.Application(middlewares=[_auth_middleware(tokens)], client_max_size=MAX_BODY_BYTES)
    app[AGENT_KEY] = agent
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/state", _state)
    app.router.add_post("/v1/updates", _post_update)
    app.router.add_get("/v1/updates/{id}", _get_update)
    app.router.add_post("/v1/updates/{id}/abort", _abort_update)
    app.router.add_route("*", "/v1/{tail:.*}", _not_found)
    # vLLM's native weight-transfer routes for trainers, fronted (transfer_routes.py).
    add_transfer_routes(app, agent, lambda presented: tokens.matches(presented))
    if manage_agent:

        async def lifecycle(_: web.Application) -> Any:
            await agent.start()
            yield
            await agent.stop()

        app.cleanup_ctx.append(lifecycle)
    return app
