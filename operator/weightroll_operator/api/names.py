"""Kubernetes object names as the API defines them, and the one way a name enters a URL path.

Every name the operator puts into a request path (a Secret, a pod, a WeightUpdate, a Lease, an
Event, a namespace) comes from a user's object. A name like ``../../team-b/secrets/agent-token``
would, unquoted, walk the path into another namespace once the HTTP client resolves the dot
segments (issue 28 item 1: another team's agent token read and sent to the attacker's pod). So a
name is checked against the API's own grammar at every edge — the CRD schema, the webhook (both
through :class:`~weightroll_operator.api.v1alpha1.SecretKeyRef`) and the client — and quoted as
one path segment (:func:`path_segment`), so even a grammar we got wrong cannot add a segment.

Grammars (``k8s.io/apimachinery/pkg/util/validation``): a DNS-1123 subdomain (most object names,
at most 253 characters), a DNS-1123 label (namespaces, at most 63), and a ConfigMap/Secret data
key (``[-._a-zA-Z0-9]+``, at most 253, never ``.``/``..`` nor starting with ``..``). Checked with
``fullmatch``: Python's ``$`` also matches before a final newline (``"a\n"`` passed ``match``; the
generated test found it), where the API server's Go patterns do not.
"""

from __future__ import annotations

import functools
import re
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Annotated, Final
from urllib.parse import quote

from pydantic import AfterValidator, StringConstraints

__all__ = [
    "DNS_LABEL_PATTERN",
    "DNS_SUBDOMAIN_PATTERN",
    "SECRET_KEY_PATTERN",
    "ObjectName",
    "SecretKey",
    "agent_address",
    "check_secret_key",
    "is_dns_label",
    "is_dns_subdomain",
    "path_segment",
]

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
#: A DNS-1123 subdomain: lower-case labels joined by dots (``IsDNS1123Subdomain``).
DNS_SUBDOMAIN_PATTERN: Final = rf"^{_LABEL}(\.{_LABEL})*$"
#: A DNS-1123 label (``IsDNS1123Label``): namespace names.
DNS_LABEL_PATTERN: Final = rf"^{_LABEL}$"
#: A key of a Secret's ``data`` (``IsConfigMapKey``).
SECRET_KEY_PATTERN: Final = r"^[-._a-zA-Z0-9]+$"
_SUBDOMAIN_RE = re.compile(DNS_SUBDOMAIN_PATTERN)
_LABEL_RE = re.compile(DNS_LABEL_PATTERN)
_KEY_RE = re.compile(SECRET_KEY_PATTERN)


def is_dns_subdomain(value: str) -> bool:
    return len(value) <= 253 and _SUBDOMAIN_RE.fullmatch(value) is not None


def is_dns_label(value: str) -> bool:
    return len(value) <= 63 and _LABEL_RE.fullmatch(value) is not None


def check_secret_key(value: str) -> str:
    """``value`` if it is a valid Secret data key; ``ValueError`` naming the rule otherwise.

    The pattern alone admits ``.`` and ``..``, which the API refuses (they are path names when a
    Secret is mounted), so they are refused here too.
    """
    if (
        not (len(value) <= 253 and _KEY_RE.fullmatch(value))
        or value in (".", "..")
        or (value.startswith(".."))
    ):
        raise ValueError(
            f"must be a Secret data key ([-._a-zA-Z0-9], at most 253 characters, not '.' or "
            f"'..' nor starting with '..'), got {value[:80]!r}"
        )
    return value


#: An object name in the API's grammar; the pattern and length reach the CRD schema too.
ObjectName = Annotated[str, StringConstraints(pattern=DNS_SUBDOMAIN_PATTERN, max_length=253)]
#: A Secret data key (pattern and length in the CRD; ``.``/``..`` refused by the validator).
SecretKey = Annotated[
    str,
    StringConstraints(pattern=SECRET_KEY_PATTERN, max_length=253),
    AfterValidator(check_secret_key),
]


def path_segment(value: str, *, namespace: bool = False) -> str:
    """``value`` as one URL path segment, after checking it is a Kubernetes name.

    Args:
        value: an object name (DNS-1123 subdomain) or, with ``namespace``, a namespace name
            (DNS-1123 label).

    Raises:
        ValueError: ``value`` is not such a name (no request must be made with it).
    """
    valid = is_dns_label(value) if namespace else is_dns_subdomain(value)
    if not valid:
        kind = (
            "namespace name (DNS-1123 label)" if namespace else "object name (DNS-1123 subdomain)"
        )
        raise ValueError(f"not a Kubernetes {kind}: {value[:80]!r}")
    # A valid name needs no quoting; quoting anyway keeps a grammar mistake from adding segments.
    return quote(value, safe="")


# Pure, and the addresses are immutable: a pass asks thousands of agents and ``ip_address``
# parsing cost more than the call to the agent double at 10,000 pods. One entry per pod IP.
@functools.lru_cache(maxsize=1 << 17)
def agent_address(text: str) -> IPv4Address | IPv6Address | None:
    """A pod IP an agent may be called at, or ``None``.

    ``status.podIP`` is parsed, never pasted into a URL: a value that is not one address, or one
    no pod can have (unspecified, multicast, link-local — where cloud metadata services answer),
    is refused, so no request leaves for an address the pod does not own. Loopback stays allowed:
    the dev cluster's pods listen there.
    """
    try:
        ip = ip_address(text)
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast or ip.is_link_local:
        return None
    if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
        return agent_address(str(ip.ipv4_mapped))
    return ip
