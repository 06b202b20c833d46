"""Trainer side of the verified push: a ``VLLMWeightSyncClient`` for the agent, and a fleet push.

A trainer pushes weights through vLLM's own trainer engines (``WeightTransferTrainerFactory.
trainer_init(...)``) with :class:`AgentSyncClient` as the client: it posts the native routes to a
replica's **agent** (not to vLLM), carrying the agent's bearer token. ::

    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from engine_agent.trainer import AgentSyncClient, gloo_init_info

    client = AgentSyncClient("http://replica-0:8470", token_file="/var/run/weightroll/token")
    engine = WeightTransferTrainerFactory.trainer_init(
        gloo_init_info(client), client=client, source=ModuleSource(model)
    )
    engine.send_weights(weight_version="step-7")   # raises PushRejected unless verified

Every failure is an exception: :class:`PushRejected` (the agent refused; ``error`` is its
``ErrorBody``, naming missing or duplicated shards) or :class:`ReplicaUnreachable`.

TLS: with ``ca_file`` the agent's certificate must chain to that CA (the chart's agent CA,
``<fullname>-agent-ca``) and name ``server_name`` (the chart's agents present
``weightroll-agent.<namespace>.svc``; the URL may then use the pod IP), as the operator's client
checks it. Redirects are never followed: a redirect would carry the token to another host.

:func:`push_fleet` updates N replicas: one transfer group per replica (a failing replica cannot
stall the others' collectives), pushed concurrently, one :class:`ReplicaResult` per replica —
``committed``, ``failed`` (with the agent's reason; that replica stays fenced and drained) or
``unreachable``.

Imports vLLM (the trainer engines) and torch; the HTTP client is the standard library's.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

import engine_agent.transfer as _transfer
from engine_agent.transfer.gloo import GlooTrainerInitInfo, free_port

__all__ = [
    "AgentSyncClient",
    "CheckpointSource",
    "PushRejected",
    "ReplicaResult",
    "ReplicaUnreachable",
    "gloo_init_info",
    "push_fleet",
]

logger = logging.getLogger(__name__)

_transfer.register_backends()  # weightroll_gloo in WeightTransferTrainerFactory


_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class PushRejected(RuntimeError):
    """The agent answered an error; ``error`` is its ``ErrorBody`` (``code``, ``message``)."""

    def __init__(self, route: str, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"{route}: HTTP {status} {error.get('code')}: {error.get('message')}")
        self.route = route
        self.status = status
        self.error = error


class ReplicaUnreachable(ConnectionError):
    """The agent could not be reached."""


class _NamedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to the URL's address, verifying the certificate for ``server_name`` instead."""

    def __init__(self, *args: Any, server_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)  # TCP only; TLS below, with our name
        context: ssl.SSLContext = self._context  # type: ignore[attr-defined]
        self.sock = context.wrap_socket(self.sock, server_hostname=self._server_name)


class _TLSHandler(urllib.request.HTTPSHandler):
    def __init__(self, context: ssl.SSLContext, server_name: str | None) -> None:
        super().__init__(context=context)
        self._tls, self._server_name = context, server_name

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        if self._server_name is None:
            return super().https_open(req)
        connection = functools.partial(_NamedHTTPSConnection, server_name=self._server_name)
        return self.do_open(connection, req, context=self._tls)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is an error: following it would send the bearer token elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class AgentSyncClient:
    """``VLLMWeightSyncClient`` (vLLM's structural protocol) for one replica's agent.

    Args:
        base_url: the agent's URL (its own port, not vLLM's); ``https://`` with TLS.
        token: the bearer token, or ``token_file`` to read it from (re-read on every call; its
            first non-empty line, as the operator sends it, so a file mid-rotation works).
        timeout: seconds per HTTP call (``update_weights`` lasts the whole broadcast).
        ca_file: PEM CA bundle the agent's certificate must chain to (needs ``https://``).
        server_name: the name the certificate must carry when it is not the URL's host (the
            chart's agents: ``weightroll-agent.<namespace>.svc``).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 600.0,
        ca_file: str | Path | None = None,
        server_name: str | None = None,
    ) -> None:
        if (token is None) == (token_file is None):
            raise ValueError("pass exactly one of token and token_file")
        self.base_url = base_url.rstrip("/")
        if (ca_file is not None or server_name is not None) and not self.base_url.startswith(
            "https://"
        ):
            raise ValueError(f"{self.base_url}: ca_file and server_name need an https:// URL")
        context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._opener = urllib.request.build_opener(_TLSHandler(context, server_name), _NoRedirects)
        self._token = token
        self._token_file = None if token_file is None else Path(token_file)
        self.timeout = timeout
        #: The answer of the last successful ``finish_weight_update`` (version, ranks).
        self.last_finish: dict[str, Any] | None = None

    def _bearer(self) -> str:
        if self._token_file is not None:
            # The first non-empty line: during a rotation the file holds two tokens, one a
            # line (docs/architecture.md, "Threat model"), and the first is the one to send.
            lines = (line.strip() for line in self._token_file.read_text().splitlines())
            return next((line for line in lines if line), "")
        assert self._token is not None
        return self._token

    def _call(self, method: str, route: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.base_url}{route}",
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self._bearer()}",
                "Content-Type": "application/json",
            },
        )
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                answer: dict[str, Any] = json.loads(response.read() or b"{}")
                return answer
        except urllib.error.HTTPError as e:
            try:
                error = json.loads(e.read() or b"{}")
            except ValueError:
                error = {}
            if not isinstance(error, dict):
                error = {}
            error.setdefault("code", "http_error")
            error.setdefault("message", e.reason)
            raise PushRejected(route, e.code, error) from e
        except (urllib.error.URLError, OSError) as e:
            raise ReplicaUnreachable(f"{self.base_url}{route}: {e}") from e

    # -- VLLMWeightSyncClient ------------------------------------------------------------

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update", {})

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._call("POST", "/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {} if weight_version is None else {"weight_version": weight_version}
        self.last_finish = self._call("POST", "/finish_weight_update", body)

    # -- extras --------------------------------------------------------------------------

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("POST", "/shutdown_weight_transfer_engine", {})

    def weight_info(self) -> dict[str, Any]:
        """``{"weight_version": <last verified commit>, "world_size": <ranks>}``."""
        return self._call("GET", "/weight_info")


class CheckpointSource(WeightSource):
    """A ``WeightSource`` over a safetensors checkpoint directory (HF names, file order).

    Args:
        path: directory with ``*.safetensors`` files (or one file).
        select: keep only the names it accepts (default: every tensor).
    """

    def __init__(self, path: str | Path, select: Callable[[str], bool] | None = None) -> None:
        from safetensors import safe_open

        root = Path(path)
        self.files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not self.files:
            raise FileNotFoundError(f"no *.safetensors under {root}")
        self._names: list[tuple[Path, str]] = []
        self._meta: list[ParamMeta] = []
        for file in self.files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if select is not None and not select(name):
                        continue
                    sliced = handle.get_slice(name)
                    dtype = _DTYPES[sliced.get_dtype()]
                    self._names.append((file, name))
                    self._meta.append(ParamMeta(name, dtype, tuple(sliced.get_shape())))

    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            with safe_open(str(file), framework="pt") as handle:
                for path, name in self._names:
                    if path == file:
                        yield name, handle.get_tensor(name)


def gloo_init_info(
    client: AgentSyncClient,
    *,
    master_address: str = "127.0.0.1",
    master_port: int | None = None,
    rank: int = 0,
    timeout_s: float = 300.0,
) -> GlooTrainerInitInfo:
    """Trainer init info of ``weightroll_gloo`` for ``client``'s replica.

    ``master_address`` must be reachable from the replica's workers; the world size is 1 (the
    trainer) plus the replica's ranks, read from the agent's ``/weight_info``.
    """
    world = client.weight_info().get("world_size")
    if not isinstance(world, int) or world < 1:
        raise ReplicaUnreachable(f"{client.base_url}: the agent does not know vLLM's world size")
    return GlooTrainerInitInfo(
        master_address=master_address,
        master_port=master_port or free_port(master_address),
        world_size=1 + world,
        timeout_s=timeout_s,
        rank=rank,
    )


@dataclass(frozen=True, slots=True)
class ReplicaResult:
    """What one replica did with a fleet push."""

    url: str
    outcome: Literal["committed", "failed", "unreachable"]
    #: The version the replica committed (``committed`` only).
    version: str | None = None
    #: Why it did not commit (the agent's message, or the connection error).
    reason: str = ""
    #: The agent's error code (``failed`` only), e.g. ``coverage_incomplete``.
    code: str | None = None
    #: Every rank's finish report as the agent answered it (``committed`` only).
    ranks: tuple[dict[str, Any], ...] = ()


def push_fleet(
    replicas: Sequence[AgentSyncClient],
    source: Any,
    *,
    weight_version: str,
    master_address: str = "127.0.0.1",
    init_info: Callable[[AgentSyncClient], GlooTrainerInitInfo] | None = None,
) -> list[ReplicaResult]:
    """Push ``source`` (a vLLM ``WeightSource``) to every replica; one result per replica.

    Each replica gets its own ``weightroll_gloo`` group and its push runs concurrently with the
    others. A replica that fails is fenced by its agent and stays drained; the others commit
    ``weight_version``. The order of the results is the order of ``replicas``.
    """
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    def one(client: AgentSyncClient) -> ReplicaResult:
        engine = None
        try:
            info = (init_info or (lambda c: gloo_init_info(c, master_address=master_address)))(
                client
            )
            engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
            engine.send_weights(weight_version=weight_version)  # type: ignore[call-arg]
            answer = client.last_finish or {}
            return ReplicaResult(
                client.base_url,
                "committed",
                version=answer.get("weight_version", weight_version),
                ranks=tuple(answer.get("ranks", ())),
            )
        except PushRejected as e:
            return ReplicaResult(
                client.base_url, "failed", reason=str(e.error.get("message")), code=e.error["code"]
            )
        except ReplicaUnreachable as e:
            return ReplicaResult(client.base_url, "unreachable", reason=str(e))
        except Exception as e:  # the transport broke (peer died mid-broadcast)
            logger.warning("Push to %s failed: %s", client.base_url, e)
            return ReplicaResult(client.base_url, "failed", reason=f"{type(e).__name__}: {e}")
        finally:
            if engine is not None:
                engine.shutdown()

    with ThreadPoolExecutor(max_workers=max(1, len(replicas))) as pool:
        return list(pool.map(one, replicas))
