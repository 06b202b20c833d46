"""The sidecar's only client of the local vLLM OpenAI server (loopback, dev-mode routes).

Every request the agent makes to vLLM goes through :class:`VllmClient`, so this module is where
the loopback rule, the timeouts and the mapping of HTTP failures to :class:`EngineError` classes
live. It knows nothing about updates: it moves bytes and classifies failures.

Invariants:
    * The base URL must be ``http://`` to a loopback address (``127.0.0.0/8``, ``::1`` or
      ``localhost``). vLLM's dev-mode routes (``/collective_rpc``, ``/pause``, …) are
      unauthenticated, so the agent refuses to drive a vLLM it would reach over the network
      (engine-reload.md R11).
    * Every call is bounded: ``collective_rpc`` passes ``timeout`` to vLLM *and* bounds the HTTP
      request by ``timeout + RPC_GRACE_SECONDS``, so a rank that hangs, or an engine core that is
      stuck behind it, surfaces as :class:`EngineTimeout` and never blocks the agent.
    * A returned ``collective_rpc`` is not proof: this module returns the raw per-rank results;
      :mod:`~engine_agent.sidecar.rounds` and :mod:`~engine_agent.sidecar.agreement` decide
      whether they amount to agreement.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import aiohttp

from engine_agent.protocol import DrainMode, ExtensionRpc

__all__ = [
    "RPC_GRACE_SECONDS",
    "EngineError",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnavailable",
    "VllmClient",
    "parse_gauge",
    "require_loopback",
]

logger = logging.getLogger(__name__)

#: Extra seconds the HTTP request to ``/collective_rpc`` may take beyond the RPC timeout given
#: to vLLM, so vLLM's own timeout error (which names the method) normally wins.
RPC_GRACE_SECONDS: Final = 5.0
#: Timeout of the small control calls (``/is_paused``, ``/resume``, ``/get_world_size`` …).
CONTROL_TIMEOUT_SECONDS: Final = 10.0


class EngineError(Exception):
    """A call to the local vLLM server failed.

    Attributes:
        code: machine-readable reason (verdict prefix and metric label).
    """

    code = "engine_error"


class EngineUnavailable(EngineError):
    """vLLM cannot be reached (connection refused or reset, 5xx): down or restarting."""

    code = "engine_unavailable"


class EngineTimeout(EngineError):
    """vLLM (or a rank behind it) did not answer within the bound."""

    code = "engine_timeout"


class EngineRejected(EngineError):
    """vLLM answered 4xx: the route is missing (dev mode off?) or the request was refused."""

    code = "engine_rejected"


def require_loopback(url: str) -> str:
    """Return ``url`` without a trailing slash if it is ``http://`` to a loopback host.

    Raises:
        ValueError: another scheme, a non-loopback host, or no host at all.
    """
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise ValueError(f"vLLM URL must use http:// on loopback, got {url!r}")
    host = parts.hostname
    if host is None:
        raise ValueError(f"vLLM URL has no host: {url!r}")
    if host != "localhost":
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"vLLM URL host {host!r} is not a loopback address; the dev-mode routes are "
                "unauthenticated, so the agent only talks to vLLM on 127.0.0.1, ::1 or localhost"
            ) from None
        if not address.is_loopback:
            raise ValueError(
                f"vLLM URL host {host!r} is not a loopback address; the dev-mode routes are "
                "unauthenticated, so the agent only talks to vLLM on 127.0.0.1, ::1 or localhost"
            )
    return url.rstrip("/")


def parse_gauge(metrics_text: str, name: str) -> float | None:
    """Sum every sample of metric ``name`` in Prometheus text format (``None`` if absent)."""
    total: float | None = None
    for line in metrics_text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name) :]
        if rest and rest[0] not in "{ ":
            continue  # a longer metric name with the same prefix
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        total = value if total is None else total + value
    return total


class VllmClient:
    """Async client of one local vLLM server; create it inside the running event loop.

    Args:
        base_url: loopback URL of the vLLM OpenAI server (checked by :func:`require_loopback`).
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = require_loopback(base_url)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # No pooling surprises across vLLM restarts: a fresh connection per request is
            # cheap on loopback and never reuses a socket to a dead server.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True),
                raise_for_status=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        timeout: float,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        what: str | None = None,
    ) -> tuple[int, str]:
        what = what or f"{method} {path}"
        try:
            async with self._http().request(
                method,
                f"{self.base_url}{path}",
                params=params,
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                text = await response.text()
                status = response.status
        except TimeoutError as e:
            raise EngineTimeout(f"{what}: no answer from vLLM within {timeout:g}s") from e
        except aiohttp.ClientError as e:
            raise EngineUnavailable(f"{what}: vLLM unreachable ({type(e).__name__}: {e})") from e
        if status >= 500:
            raise EngineUnavailable(f"{what}: vLLM answered {status}: {_short(text)}")
        if status >= 400:
            raise EngineRejected(f"{what}: vLLM answered {status}: {_short(text)}")
        return status, text

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        _, text = await self._request(method, path, **kwargs)
        if not text:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise EngineError(f"{method} {path}: vLLM answered non-JSON: {_short(text)}") from e

    async def health(self) -> bool:
        """Return whether ``GET /health`` answers 200 (never raises)."""
        try:
            await self._request("GET", "/health", timeout=CONTROL_TIMEOUT_SECONDS)
        except EngineError:
            return False
        return True

    async def world_size(self) -> int:
        """Return TP·PP·DP from ``GET /get_world_size?include_dp=true``."""
        data = await self._json(
            "GET",
            "/get_world_size",
            params={"include_dp": "true"},
            timeout=CONTROL_TIMEOUT_SECONDS,
        )
        size = data.get("world_size") if isinstance(data, dict) else None
        if not isinstance(size, int) or size < 1:
            raise EngineError(f"GET /get_world_size: unexpected answer {data!r}")
        return size

    async def pause(self, mode: DrainMode, timeout: float) -> None:
        """``POST /pause?mode=…&clear_cache=true``; returns when vLLM reports paused.

        Raises:
            EngineTimeout: in ``wait`` mode, the running requests did not finish in time.
        """
        await self._request(
            "POST",
            "/pause",
            params={"mode": mode.value, "clear_cache": "true"},
            timeout=timeout,
            what=f"pause (mode={mode.value})",
        )

    async def resume(self) -> None:
        await self._request("POST", "/resume", timeout=CONTROL_TIMEOUT_SECONDS)

    async def is_paused(self) -> bool:
        data = await self._json("GET", "/is_paused", timeout=CONTROL_TIMEOUT_SECONDS)
        paused = data.get("is_paused") if isinstance(data, dict) else None
        if not isinstance(paused, bool):
            raise EngineError(f"GET /is_paused: unexpected answer {data!r}")
        return paused

    async def weight_version(self) -> str:
        """vLLM's own weight-version label (``GET /weight_info``; ``"default"`` after start)."""
        data = await self._json("GET", "/weight_info", timeout=CONTROL_TIMEOUT_SECONDS)
        version = data.get("weight_version") if isinstance(data, dict) else None
        if not isinstance(version, str):
            raise EngineError(f"GET /weight_info: unexpected answer {data!r}")
        return version

    async def set_weight_version(self, version: str) -> None:
        """``POST /update_weight_version``: the acceptance marker that outlives the agent."""
        await self._request(
            "POST",
            "/update_weight_version",
            body={"new_version": version},
            timeout=CONTROL_TIMEOUT_SECONDS,
            what="update_weight_version",
        )

    async def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache``; ``False`` while blocks are still held."""
        data = await self._json("POST", "/reset_prefix_cache", timeout=CONTROL_TIMEOUT_SECONDS)
        return bool(isinstance(data, dict) and data.get("success"))

    async def metrics_text(self) -> str:
        _, text = await self._request("GET", "/metrics", timeout=CONTROL_TIMEOUT_SECONDS)
        return text

    async def num_requests_running(self) -> float | None:
        """``vllm:num_requests_running`` summed over engines, or ``None`` if unavailable."""
        try:
            return parse_gauge(await self.metrics_text(), "vllm:num_requests_running")
        except EngineError:
            return None

    async def post_json(self, path: str, body: Any, timeout: float) -> Any:
        """POST ``body`` to a dev route (the native weight-transfer routes); return the answer.

        Raises:
            EngineError subclasses, as for every call (a 500 carries vLLM's text).
        """
        return await self._json("POST", path, body=body, timeout=timeout)

    async def collective_rpc(self, method: ExtensionRpc, arg: str, timeout: float) -> list[Any]:
        """Call ``method(arg)`` on every rank; return the raw per-rank results.

        Args:
            method: the worker-extension method (one name list with the extension).
            arg: the one JSON-string argument.
            timeout: seconds vLLM may wait for the ranks.

        Raises:
            EngineTimeout: no answer within ``timeout + RPC_GRACE_SECONDS`` (or vLLM's own
                timeout fired).
            EngineUnavailable / EngineRejected / EngineError: as for every call; also when the
                answer has no ``results`` list.
        """
        body = {"method": method, "args": [arg], "kwargs": {}, "timeout": timeout}
        try:
            data = await self._json(
                "POST",
                "/collective_rpc",
                body=body,
                timeout=timeout + RPC_GRACE_SECONDS,
                what=method,
            )
        except EngineUnavailable as e:
            # vLLM turns a worker-side timeout into a 500; name it as the timeout it is.
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                raise EngineTimeout(str(e)) from e
            raise
        results = data.get("results") if isinstance(data, dict) else None
        if not isinstance(results, list):
            raise EngineError(f"{method}: collective_rpc answered without a results list")
        return results


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


async def wait_until_reachable(client: VllmClient, deadline_s: float, poll_s: float = 1.0) -> bool:
    """Poll ``/health`` until it answers or ``deadline_s`` passes; return whether it answered."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while True:
        if await client.health():
            return True
        if loop.time() >= end:
            return False
        await asyncio.sleep(poll_s)
