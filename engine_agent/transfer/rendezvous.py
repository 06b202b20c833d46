"""Who a replica may rendezvous with: the trainer networks allow-list, checked before any peer.

vLLM's weight-transfer init info names a peer the workers connect to (``master_address`` /
``master_port``): with NCCL, vLLM's ``StatelessProcessGroup`` then **unpickles** what that peer
publishes, so whoever may name the peer may run code in every worker. The platform team
therefore names the networks trainers run in, and nothing else is ever contacted:

* the agent (``--trainer-networks`` / ``WEIGHTROLL_AGENT_TRAINER_NETWORKS``) checks a trainer's
  ``init_info`` before vLLM is asked anything; empty (the default) refuses every trainer push;
* every rank (``WEIGHTROLL_TRAINER_NETWORKS`` in the vLLM container) checks it again inside
  weightroll's backends before it connects, so a caller that reaches vLLM's loopback routes
  directly, or a defect in the agent, still cannot point a worker at another host.

Rules (:func:`check_init_info`): only known fields; ``master_address`` must be an IP address
literal (parsed with :mod:`ipaddress`, never compared as a string; a host name could resolve
anywhere, and an IPv4-mapped IPv6 address counts as its IPv4 address) inside one of the
networks, and not an unspecified address; ``master_port`` 1-65535; NCCL's pre-shared unique id
(``nccl_unique_id_b64``) is refused, since it embeds a bootstrap address nobody checks.
:func:`check_update_info` refuses pickled payloads (vLLM IPC's ``ipc_handles_pickled``).

Pure standard library: the sidecar imports it (no torch, no vLLM).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = [
    "AGENT_SETTING",
    "WORKER_ENV",
    "Network",
    "RendezvousRefused",
    "check_init_info",
    "check_update_info",
    "networks_from_env",
    "parse_networks",
    "require_networks",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: The agent's setting, as error messages name it.
AGENT_SETTING: Final = (
    "--trainer-networks / WEIGHTROLL_AGENT_TRAINER_NETWORKS (chart: "
    "workloadExample.trainerNetworks)"
)
#: The variable every vLLM worker reads (the vLLM container's environment).
WORKER_ENV: Final = "WEIGHTROLL_TRAINER_NETWORKS"
WORKER_SETTING: Final = (
    f"{WORKER_ENV} in the vLLM container (chart: workloadExample.trainerNetworks)"
)

#: Init-info fields of the backends that may come through (weightroll_gloo, weightroll_nccl's
#: TCPStore mode, weightroll_ipc); anything else could name a peer nobody checks.
KNOWN_FIELDS: Final = frozenset(
    {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "timeout_s",
        "batch_bytes",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
    }
)


class RendezvousRefused(ValueError):
    """A trainer's init or update info is refused; ``code`` is the ``ErrorBody`` code.

    ``trainer_push_disabled``: no trainer networks configured; ``rendezvous_not_allowed``: the
    peer is not an IP address inside them (or the rendezvous mode cannot be checked);
    ``insecure_serialization``: a pickled payload; ``invalid_request``: a malformed field.
    """

    def __init__(self, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


def parse_networks(entries: str | Iterable[str]) -> tuple[Network, ...]:
    """Parse an allow-list: networks (``10.0.0.0/8``) or single addresses, comma or space
    separated when given as one string.

    Raises:
        ValueError: an entry is not an IP network (host bits set, a host name, ...); the
            message names it.
    """
    items = entries.replace(",", " ").split() if isinstance(entries, str) else list(entries)
    networks: list[Network] = []
    for item in items:
        text = item.strip()
        if not text:
            continue
        try:
            networks.append(ipaddress.ip_network(text, strict=True))
        except ValueError as e:
            raise ValueError(
                f"trainer network {text!r} is not an IP network (e.g. 10.20.0.0/16 or "
                f"10.20.0.7): {e}"
            ) from e
    return tuple(networks)


def networks_from_env(environ: Mapping[str, str] | None = None) -> tuple[Network, ...]:
    """The worker's allow-list from :data:`WORKER_ENV` (empty when unset).

    Raises:
        RendezvousRefused: the variable does not parse (``trainer_push_disabled``).
    """
    text = (os.environ if environ is None else environ).get(WORKER_ENV, "")
    try:
        return parse_networks(text)
    except ValueError as e:
        raise RendezvousRefused("trainer_push_disabled", f"{WORKER_SETTING}: {e}") from e


def _address(value: Any, networks: tuple[Network, ...], setting: str) -> None:
    if not isinstance(value, str):
        raise RendezvousRefused(
            "invalid_request",
            f"init_info.master_address: must be a string, got {type(value).__name__}",
            "init_info.master_address",
        )
    try:
        address = ipaddress.ip_address(value)
    except ValueError as e:
        raise RendezvousRefused(
            "rendezvous_not_allowed",
            f"init_info.master_address {value!r} is not an IP address; name the trainer by "
            "its IP address (a host name could resolve to any host)",
            "init_info.master_address",
        ) from e
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # it reaches the IPv4 host: judge it as that
    if address.is_unspecified or address.is_multicast:
        raise RendezvousRefused(
            "rendezvous_not_allowed",
            f"init_info.master_address {value!r} is not a host address",
            "init_info.master_address",
        )
    if not any(address.version == net.version and address in net for net in networks):
        allowed = ", ".join(str(net) for net in networks)
        raise RendezvousRefused(
            "rendezvous_not_allowed",
            f"init_info.master_address {value!r} is outside the trainer networks ({allowed}); "
            f"the platform team configures them with {setting}",
            "init_info.master_address",
        )


def require_networks(networks: tuple[Network, ...], *, setting: str = AGENT_SETTING) -> None:
    """Refuse every trainer push while no trainer network is configured.

    Raises:
        RendezvousRefused: ``trainer_push_disabled``, naming ``setting``.
    """
    if not networks:
        raise RendezvousRefused(
            "trainer_push_disabled",
            f"trainer pushes are disabled on this replica: no trainer networks are configured "
            f"({setting}); the platform team lists the networks trainers may rendezvous from",
        )


def check_init_info(
    init_info: Any, networks: tuple[Network, ...], *, setting: str = AGENT_SETTING
) -> None:
    """Refuse an ``init_info`` that would make a worker contact a peer outside ``networks``.

    ``setting`` names where the allow-list comes from (for the message).

    Raises:
        RendezvousRefused: see the module docstring for the rules.
    """
    require_networks(networks, setting=setting)
    if not isinstance(init_info, Mapping):
        raise RendezvousRefused("invalid_request", "init_info: must be a JSON object", "init_info")
    # An unset optional field (null) is absent, as vLLM's own payloads drop it.
    init_info = {key: value for key, value in init_info.items() if value is not None}
    if "nccl_unique_id_b64" in init_info:
        raise RendezvousRefused(
            "rendezvous_not_allowed",
            "init_info.nccl_unique_id_b64: a pre-shared NCCL unique id embeds a bootstrap "
            "address that cannot be checked against the trainer networks; use the "
            "master_address/master_port rendezvous",
            "init_info.nccl_unique_id_b64",
        )
    unknown = sorted(str(key) for key in init_info if key not in KNOWN_FIELDS)
    if unknown:
        raise RendezvousRefused(
            "invalid_request",
            f"init_info: unknown field(s) {', '.join(unknown)} (known: "
            f"{', '.join(sorted(KNOWN_FIELDS))})",
            f"init_info.{unknown[0]}",
        )
    has_address, has_port = "master_address" in init_info, "master_port" in init_info
    if has_address != has_port:
        raise RendezvousRefused(
            "invalid_request",
            "init_info: master_address and master_port go together",
            "init_info.master_port" if has_address else "init_info.master_address",
        )
    if not has_address:
        return  # no peer to contact (weightroll_ipc)
    _address(init_info["master_address"], networks, setting)
    port = init_info["master_port"]
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RendezvousRefused(
            "invalid_request",
            f"init_info.master_port {port!r}: must be a TCP port (1-65535)",
            "init_info.master_port",
        )


def check_update_info(update_info: Any) -> None:
    """Refuse an ``update_info`` carrying a pickled payload (it would run code on unpickling).

    Raises:
        RendezvousRefused: ``insecure_serialization``.
    """
    infos = update_info if isinstance(update_info, list) else [update_info]
    for info in infos:
        if isinstance(info, Mapping) and info.get("ipc_handles_pickled") is not None:
            raise RendezvousRefused(
                "insecure_serialization",
                "update_info.ipc_handles_pickled: pickled payloads are refused (unpickling "
                "runs code); send the weights over a transport that does not pickle",
                "update_info.ipc_handles_pickled",
            )
