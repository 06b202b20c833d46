"""``weightroll agent``: the pod sidecar that drives one vLLM replica through verified updates.

Layers (one concern each): ``engine`` is the only client of the local vLLM server; ``ranks``
holds the pure all-rank agreement rules; ``state`` the update records and persisted memory;
``agent`` the update flow and the fail-closed guard; ``app`` the HTTP surface; ``metrics`` the
Prometheus families; ``main`` the command line. See README.md for endpoints, environment and
failure semantics. Imports neither torch nor vLLM (``.importlinter``).
"""

from engine_agent.sidecar.agent import Agent, AgentConfig
from engine_agent.sidecar.app import TokenFile, create_app

__all__ = ["Agent", "AgentConfig", "TokenFile", "create_app"]
