"""The agent's tunables: every field has an env var and a flag (``main.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path

from engine_agent.protocol import SourceSpec
from engine_agent.sidecar.confinement import confine

__all__ = ["AgentConfig"]


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Tunables of the agent; every field has an env var and a flag (see ``main.py``)."""

    #: Loopback URL of the local vLLM OpenAI server.
    vllm_url: str = "http://127.0.0.1:8000"
    #: Bound of ``weightroll_begin`` (snapshots identity on every rank).
    begin_timeout: float = 120.0
    #: Bound of ``weightroll_load`` (reads the whole checkpoint on every rank).
    load_timeout: float = 1800.0
    #: Bound of ``weightroll_finish`` (coverage, identity, digest).
    finish_timeout: float = 300.0
    #: Bound of ``weightroll_state`` and ``weightroll_abort``.
    control_timeout: float = 30.0
    #: Bound of ``/pause?mode=abort``.
    abort_pause_timeout: float = 60.0
    #: Seconds ``POST /v1/updates/{id}/abort`` waits for the update to wind down.
    abort_wait: float = 1.0
    #: Seconds between two observations by the guard.
    watch_interval: float = 5.0
    #: Seconds a trainer push may stay open without a trainer call before the agent ends it
    #: (fenced, failed as ``push_abandoned``): a trainer that died between steps never calls
    #: finish, and the replica must not stay held by it for ever.
    push_idle_timeout: float = 900.0
    #: Networks a trainer's rendezvous address (``init_info.master_address``) may lie in
    #: (``engine_agent.transfer.rendezvous``); empty refuses every trainer push.
    trainer_networks: tuple[IPv4Network | IPv6Network, ...] = ()
    #: The trainers' bearer tokens (one per line), for the native weight-transfer routes only;
    #: ``None`` closes those routes. The ``--token-file`` tokens never open them.
    trainer_token_file: Path | None = None
    #: Seconds an observation is reused by ``/readyz`` and ``/v1/state``.
    observe_ttl: float = 1.0
    #: Directory for the persisted store (an ``emptyDir``); ``None`` keeps memory only.
    state_dir: Path | None = None
    #: Source of the weights vLLM starts with (reported by ``/v1/state`` until an update).
    initial_source: SourceSpec | None = None
    #: Version vLLM starts with; ``None`` adopts what the ranks report at start-up.
    initial_version: str | None = None
    #: Directory under which weight sources and manifests are resolved (``/models/v2`` is read
    #: at ``<source_root>/models/v2``); ``None`` reads them as given. Sources keep their
    #: pod-view URIs everywhere else (records, ``/v1/state``). For pod simulators without mount
    #: namespaces (``weightroll_dev.devcluster``), where each pod has its own volume root.
    source_root: Path | None = None
    #: Directory, as the pods see it (the model volume's mount path, e.g. ``/models``), inside
    #: which every update's ``source.uri`` and ``source.manifest`` must resolve, symlinks and
    #: ``..`` followed; ``None``: inside ``source_root`` when that is set, else anywhere.
    model_dir: str | None = None
    #: PEM public key (EC) every update's manifest must be signed with (``<manifest>.sig``, an
    #: OpenSSF model-signing bundle; :mod:`engine_agent.sidecar.signing`); ``None``: unsigned.
    manifest_public_key: Path | None = None

    def local_path(self, path: str) -> str:
        """Where this process reads a source path (``path`` itself without ``source_root``)."""
        if self.source_root is None:
            return path
        return str(self.source_root / path.lstrip("/"))

    def check_source(self, source: SourceSpec) -> None:
        """Refuse a source outside :attr:`model_dir` (or :attr:`source_root`); see
        :func:`~engine_agent.sidecar.confinement.confine`.

        Raises:
            SourceRefused: naming ``source.uri`` or ``source.manifest``.
        """
        if self.model_dir is not None:
            jail, where = self.local_path(self.model_dir), f"the model directory {self.model_dir}"
        elif self.source_root is not None:
            jail, where = str(self.source_root), "the source root"
        else:
            return
        confine(source, jail=jail, where=where, local_path=self.local_path)
