"""The two I/O interfaces the reconciler depends on, as typing Protocols.

``k8s.client.KubeApi`` and ``agent_client.AgentClient`` implement them over HTTP; the benchmark
implements them in memory. Tests of the reconciler use the real HTTP implementations against
kmock and simulated agents (house rule 16: no monkeypatched clients).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine_agent.protocol import AgentState, UpdateRequest, UpdateStatus

__all__ = ["AgentPort", "AgentTarget", "KubePort", "PeerReader", "PodReader"]


@dataclass(frozen=True, slots=True)
class AgentTarget:
    """One pod's agent: where it listens and the token to send (never logged)."""

    pod: str
    base_url: str
    token: str | None = None
    #: The pod's namespace: part of the TLS server name the agent's certificate must carry.
    namespace: str = ""

    def __repr__(self) -> str:
        return f"AgentTarget(pod={self.pod!r}, base_url={self.base_url!r})"


class KubePort(Protocol):
    """The Kubernetes calls of one reconcile pass."""

    async def patch_pod_condition(
        self,
        namespace: str,
        name: str,
        condition: Mapping[str, Any],
        *,
        resource_version: str | None = None,
    ) -> str | None: ...

    async def patch_pod_metadata(
        self,
        namespace: str,
        name: str,
        *,
        annotations: Mapping[str, str | None] | None = None,
        labels: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> str | None: ...

    async def patch_weightupdate_status(
        self, namespace: str, name: str, patch: Mapping[str, Any]
    ) -> None: ...

    async def read_agent_token(self, namespace: str, name: str, key: str) -> str: ...

    async def create_event(self, namespace: str, event: Mapping[str, Any]) -> None: ...

    async def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None: ...


@runtime_checkable
class PodReader(Protocol):
    """Reads one pod from the API server (not from the index): only it can tell that an
    indexed pod is gone (``phantoms``). ``None``: no pod of that name exists."""

    async def find_pod(self, namespace: str, name: str) -> Any: ...


@runtime_checkable
class PeerReader(Protocol):
    """Lists the namespace's WeightUpdates from the API server (not from the index): only it
    can tell a pass about a peer its index does not hold yet (``domain.ownership``)."""

    async def list_weightupdates(self, namespace: str) -> list[Any]: ...


class AgentPort(Protocol):
    """The sidecar HTTP API (docs/contracts.md), one call per method."""

    async def state(self, target: AgentTarget) -> AgentState: ...

    async def get_update(self, target: AgentTarget, update_id: str) -> UpdateStatus | None: ...

    async def start_update(self, target: AgentTarget, request: UpdateRequest) -> None: ...

    async def swap_update(self, target: AgentTarget, update_id: str) -> None: ...

    async def abort_update(self, target: AgentTarget, update_id: str) -> None: ...
