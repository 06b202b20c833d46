"""``weightroll-agent``: the pod sidecar that drives one vLLM replica through verified updates.

Layers (one concern each): ``engine`` is the only client of the local vLLM server; ``ranks``
holds the pure all-rank agreement rules; ``state`` the update records and persisted memory;
``pipeline`` the one verified commit sequence, fed by ``file_update`` (the operator's updates)
and ``push`` (a trainer's pushes); ``agent`` admits them and guards the replica; ``app`` and
``transfer_routes`` the HTTP surface; ``metrics`` the Prometheus families; ``config`` and
``main`` the command line. See README.md for endpoints, environment and
failure semantics. Imports neither torch nor vLLM (``.importlinter``).
"""

from engine_agent.sidecar.agent import Agent
from engine_agent.sidecar.app import TokenFile, create_app
from engine_agent.sidecar.config import AgentConfig

__all__ = ["Agent", "AgentConfig", "TokenFile", "create_app"]
