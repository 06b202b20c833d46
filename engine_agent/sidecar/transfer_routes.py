"""The native weight-transfer routes on the agent's port, for trainers (issue 12 C).

Same names and bodies as vLLM's ``entrypoints/rl/online/api_router.py``; every one behind a
**trainer** token (``--trainer-token-file``, never the operator's ``--token-file``; without a
trainer token file the routes are closed). Each route is one step of the trainer-push feeder
(:class:`~engine_agent.sidecar.push.TransferCoordinator`, which documents what the agent adds
around vLLM's own steps), run one at a time; a failed step answers an
:class:`~engine_agent.protocol.ErrorBody`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

from aiohttp import web

from engine_agent.protocol import ErrorBody
from engine_agent.sidecar.agent import Agent
from engine_agent.sidecar.push import PushFailed, TransferCoordinator
from engine_agent.sidecar.tokens import TokenFile

__all__ = ["ROUTES", "add_transfer_routes"]

#: The native routes the agent serves (the public interface, docs/trainer.md).
ROUTES: Final = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/shutdown_weight_transfer_engine",
    "/weight_info",
)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_transfer_routes(
    app: web.Application, agent: Agent, matches: Callable[[bytes], bool]
) -> TransferCoordinator:
    """Serve :data:`ROUTES` on ``app`` for ``agent``.

    Only the trainer tokens (``agent.config.trainer_token_file``) open them; ``matches`` checks
    the operator's token, which never does (it only makes the refusal say so).
    """
    coordinator = TransferCoordinator(agent)
    path = agent.config.trainer_token_file
    trainers = None if path is None else TokenFile(path)

    def refusal(presented: bytes) -> str | None:
        if trainers is not None and trainers.matches(presented):
            return None
        if trainers is None:
            return (
                "the trainer routes are closed: no trainer token is configured "
                "(--trainer-token-file / WEIGHTROLL_AGENT_TRAINER_TOKEN_FILE)"
            )
        if matches(presented):
            return "the operator's token does not open the trainer routes; use a trainer token"
        return "missing or wrong bearer token"

    def guarded(step: Callable[[dict[str, Any]], Awaitable[Any]]) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            why = refusal(presented.strip().encode()) if scheme.lower() == "bearer" else None
            if scheme.lower() != "bearer" or why is not None:
                message = why or "missing or wrong bearer token"
                body = ErrorBody(code="unauthorized", message=message)
                return web.json_response(
                    body.to_wire(),
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="weightroll"'},
                )
            document: Any = {}
            raw = await request.read()
            if raw.strip():
                try:
                    document = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    return _error(400, "malformed_json", f"body is not valid JSON: {e}")
            if not isinstance(document, dict):
                return _error(400, "malformed_json", "body must be a JSON object")
            async with coordinator.lock:
                try:
                    answer = await step(document)
                except PushFailed as e:
                    first = e.problems[0]
                    return _error(e.status, first.code, "; ".join(map(str, e.problems)), e.field)
            return web.json_response(answer if answer is not None else {})

        return handler

    app.router.add_post("/init_weight_transfer_engine", guarded(coordinator.init))
    app.router.add_post("/start_weight_update", guarded(lambda _: coordinator.start()))
    app.router.add_post("/update_weights", guarded(coordinator.update))
    app.router.add_post("/finish_weight_update", guarded(coordinator.finish))
    app.router.add_post(
        "/shutdown_weight_transfer_engine", guarded(lambda _: coordinator.shutdown())
    )
    app.router.add_get("/weight_info", guarded(lambda _: coordinator.weight_info()))
    return coordinator


def _error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = ErrorBody(code=code, message=message, field=field)
    return web.json_response(body.to_wire(), status=status)
