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

:func:`push_fleet` updates N replicas: one transfer group per replica (a failing replica cannot
stall the others' collectives), pushed concurrently, one :class:`ReplicaResult` per replica —
``committed``, ``failed`` (with the agent's reason; that replica stays fenced and drained) or
``unreachable``.

Imports vLLM (the trainer engines) and torch; the HTTP client is the standard library's.
"""

from __future__ import annotations

import json
import logging
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


class AgentSyncClient:
    """``VLLMWeightSyncClient`` (vLLM's structural protocol) for one replica's agent.

    Args:
        base_url: the agent's URL (its own port, not vLLM's).
        token: the bearer token, or ``token_file`` to read it from (re-read on every call).
        timeout: seconds per HTTP call (``update_weights`` lasts the whole broadcast).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_file: str | Path | None = None,
        timeout: float = 600.0,
    ) -> None:
        if (token is None) == (token_file is None):
            raise ValueError("pass exactly one of token and token_file")
        self.base_url = base_url.rstrip("/")
        self._token = token
        self._token_file = None if token_file is None else Path(token_file)
        self.timeout = timeout
        #: The answer of the last successful ``finish_weight_update`` (version, ranks).
        self.last_finish: dict[str, Any] | None = None

    def _bearer(self) -> str:
        if self._token_file is not None:
            return self._token_file.read_text().strip()
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
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
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
