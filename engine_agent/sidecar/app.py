"""HTTP surface of the sidecar (aiohttp): routes, bearer-token auth and error bodies.

Routes (see README.md): ``GET /healthz``, ``GET /readyz``, ``GET /metrics`` (no auth: probes and
Prometheus), and ``GET /v1/state``, ``POST /v1/updates``, ``GET /v1/updates/{id}``,
``POST /v1/updates/{id}/abort``, ``POST /v1/updates/{id}/swap`` (bearer token), and vLLM's
native weight-transfer routes for trainers (bearer token; ``transfer_routes.py``).

Invariants:
    * Every ``/v1`` route needs ``Authorization: Bearer <token>``; the token is compared with
      :func:`hmac.compare_digest` and read from a file (a mounted Secret), re-read when the file
      changes so a rotated Secret takes effect without a restart. It is never logged.
    * The file may hold several tokens, one per line, all accepted: a rotation adds the new token
      as a second line, makes it the first (the operator sends the first line), then drops the old
      one, so no request fails while kubelet propagates each step to the pods.
    * Every error is an :class:`~engine_agent.protocol.ErrorBody` JSON: 400 for bodies that are
      not a JSON object (also nested too deeply, a number too long, ``NaN``/``Infinity``), 408
      for a body that did not arrive within ``body_timeout``, 413 for one above
      ``max_body_bytes``, 422 for validation errors (naming the field), 401, 404, 409 (naming
      the active update id in ``field``). No answer echoes the body, and none is a 500.
    * Unauthenticated callers (the kubelet's probes) learn only whether the replica is ready:
      ``/readyz`` names its reasons only to a caller presenting a token, since they can carry
      paths and errors taken from a request.
    * Handlers only translate HTTP to :class:`~engine_agent.sidecar.agent.Agent` calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web
from pydantic import ValidationError

from engine_agent.protocol import ErrorBody, UpdateRequest
from engine_agent.sidecar.agent import Agent, SourceRefused, UpdateConflict, UpdateNotFound
from engine_agent.sidecar.metrics import CONTENT_TYPE
from engine_agent.sidecar.state import UpdateRecord
from engine_agent.sidecar.tokens import TokenFile
from engine_agent.sidecar.transfer_routes import add_transfer_routes

__all__ = ["AGENT_KEY", "HttpLimits", "TokenFile", "create_app", "parse_json_object"]

logger = logging.getLogger(__name__)

#: Application key under which the :class:`Agent` is stored.
AGENT_KEY: Final = web.AppKey("agent", Agent)
#: Request bodies above this size are refused (an update request is a few hundred bytes).
MAX_BODY_BYTES: Final = 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Bounds on what one client may hold of the agent (flags in ``main.py``).

    A connection that has not sent a whole request head ``header_timeout`` seconds after it
    opened (or after its previous answer) is closed; an authenticated request whose body has not
    fully arrived ``body_timeout`` seconds after its head gets 408 and its connection is closed;
    at most ``max_connections`` connections are served at once (more are closed on accept).
    """

    #: Seconds to receive a request head (also how long an idle keep-alive connection stays).
    header_timeout: float = 30.0
    #: Seconds to receive a request body once its head arrived.
    body_timeout: float = 60.0
    #: Connections served at once; further ones are closed as soon as they are accepted.
    max_connections: int = 256
    #: Largest request body accepted (413 above).
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not (self.header_timeout > 0 and self.body_timeout > 0):
            raise ValueError("header_timeout and body_timeout must be above 0")
        if self.max_connections < 1 or self.max_body_bytes < 1:
            raise ValueError("max_connections and max_body_bytes must be at least 1")


class MalformedBody(ValueError):
    """A request body that is not a JSON object; the message never quotes the body."""


def _no_constant(name: str) -> Any:
    raise MalformedBody(f"body is not valid JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedBody("body is not valid JSON: a number is out of range")
    return value


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body that must be one JSON object.

    Raises:
        MalformedBody: not UTF-8 JSON, nested too deeply for the parser, an integer longer than
            Python converts (``sys.get_int_max_str_digits``), ``NaN``/``Infinity`` or a float
            out of range, or not an object. The message names the problem, never the body.
    """
    try:
        document = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except MalformedBody:
        raise
    except RecursionError:
        raise MalformedBody("body is not valid JSON: nested too deeply") from None
    except json.JSONDecodeError as e:
        # position only: the exception's ``doc`` is the body and is never quoted
        raise MalformedBody(
            f"body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except UnicodeDecodeError:
        raise MalformedBody("body is not valid JSON: not UTF-8 text") from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits() allows
        raise MalformedBody("body is not valid JSON: a number is too long") from None
    if not isinstance(document, dict):
        raise MalformedBody("body must be a JSON object")
    return document


#: Application key under which the :class:`TokenFile` is stored.
TOKENS_KEY: Final = web.AppKey("tokens", TokenFile)


def _error(
    status: int, code: str, message: str, field: str | None = None, **headers: str
) -> web.Response:
    body = ErrorBody(code=code, message=message, field=field).to_wire()
    return web.json_response(body, status=status, headers=headers or None)


def _authorized(request: web.Request, tokens: TokenFile) -> bool:
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and tokens.matches(presented.strip().encode())


def _auth_middleware(tokens: TokenFile) -> Any:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/v1") and not _authorized(request, tokens):
            return _error(
                401,
                "unauthorized",
                "missing or wrong bearer token",
                **{"WWW-Authenticate": 'Bearer realm="weightroll"'},
            )
        return await handler(request)

    return auth


def _body_middleware(tokens: TokenFile, limits: HttpLimits) -> Any:
    """Read an authorised POST body within ``limits`` and check it is a JSON object, before any
    handler (the transfer routes included) sees it; handlers then read the cached bytes.
    Unauthorised requests are left to the handlers, which answer 401 without reading."""

    @web.middleware
    async def body(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or not request.body_exists or not _authorized(request, tokens):
            return await handler(request)
        try:
            async with asyncio.timeout(limits.body_timeout):
                raw = await request.read()
        except TimeoutError:
            refused = _error(
                408,
                "request_timeout",
                f"the request body did not arrive within {limits.body_timeout:g} s",
            )
            refused.force_close()
            return refused
        except web.HTTPRequestEntityTooLarge:
            refused = _error(
                413, "body_too_large", f"a request body is at most {limits.max_body_bytes} bytes"
            )
            refused.force_close()
            return refused
        if raw:
            try:
                parse_json_object(raw)
            except MalformedBody as e:
                return _error(400, "malformed_json", str(e))
        return await handler(request)

    return body


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
    body: dict[str, Any] = {"ready": readiness.ready}
    # The reasons can quote a request (a manifest path, the error reading it): only for a
    # caller with the token; the kubelet's probe needs the status code alone.
    if _authorized(request, request.app[TOKENS_KEY]):
        body["reasons"] = list(readiness.reasons)
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
        document = parse_json_object(raw)
    except MalformedBody as e:
        return _error(400, "malformed_json", str(e))
    try:
        update = UpdateRequest.model_validate(document)
    except ValidationError as e:
        return _validation_error(e)
    agent = request.app[AGENT_KEY]
    try:
        created, record = agent.submit(update)
    except SourceRefused as e:
        return _error(422, "invalid_request", str(e), field=e.field)
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


async def _act_on_update(
    request: web.Request, act: Callable[[str], Awaitable[UpdateRecord]]
) -> web.Response:
    """``POST /v1/updates/{id}/<verb>``: 404 unknown, 409 refused, else the record: 202 while
    the update still runs (an abort winding down, a swap draining and applying; poll GET for
    the verdict), 200 once it is terminal."""
    update_id = request.match_info["id"]
    try:
        record = await act(update_id)
    except UpdateNotFound:
        return _error(404, "not_found", f"no update with id {update_id!r}", field="id")
    except UpdateConflict as e:
        return _error(409, "conflict", str(e), field="id")
    status = 200 if record.phase.terminal else 202
    return web.json_response(record.to_status().to_wire(), status=status)


async def _abort_update(request: web.Request) -> web.Response:
    return await _act_on_update(request, request.app[AGENT_KEY].abort)


async def _swap_update(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]

    async def swap(update_id: str) -> UpdateRecord:
        return agent.swap(update_id)

    return await _act_on_update(request, swap)


async def _not_found(request: web.Request) -> web.Response:
    return _error(404, "not_found", f"no route {request.method} {request.path}")


def create_app(
    agent: Agent,
    tokens: TokenFile,
    *,
    manage_agent: bool = True,
    limits: HttpLimits | None = None,
) -> web.Application:
    """Build the aiohttp application.

    Args:
        agent: the agent the routes drive.
        tokens: the bearer token source for ``/v1``.
        manage_agent: start and stop the agent with the application (tests may do it themselves).
        limits: body timeout and size (the head timeout and connection bound are the server's,
            ``listener.serve``); default :class:`HttpLimits`.
    """
    limits = limits or HttpLimits()
    app = web.Application(
        middlewares=[_auth_middleware(tokens), _body_middleware(tokens, limits)],
        client_max_size=limits.max_body_bytes,
    )
    app[AGENT_KEY] = agent
    app[TOKENS_KEY] = tokens
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/readyz", _readyz)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/state", _state)
    app.router.add_post("/v1/updates", _post_update)
    app.router.add_get("/v1/updates/{id}", _get_update)
    app.router.add_post("/v1/updates/{id}/abort", _abort_update)
    app.router.add_post("/v1/updates/{id}/swap", _swap_update)
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
