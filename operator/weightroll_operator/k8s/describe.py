"""What went wrong talking to the API server, in the words kubectl uses for the same failure.

A user who reads ``The connection to the server 10.0.0.1:6443 was refused - did you specify the
right host or port?`` knows what to check, because kubectl says exactly that; the repr of an
aiohttp exception (with its ``ConnectionKey``) says nothing more and buries the point. These lines
are built from our side only (the exception's type, the host we dialled, the context we were
given), never from a response body or header.
"""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from weightroll_operator.errors import KubeError

__all__ = ["kubeconfig_line", "unreachable_line"]


def _host(server: str) -> str:
    return urlsplit(server).netloc or server


def _causes(error: BaseException) -> list[BaseException]:
    """The exception and everything below it (``__cause__``, aiohttp's ``os_error``)."""
    seen: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and current not in seen:
        seen.append(current)
        below = getattr(current, "os_error", None)
        current = below if isinstance(below, BaseException) else current.__cause__
    return seen


def unreachable_line(error: KubeError, server: str) -> str:
    """kubectl's line for an API server that gave no usable answer (``KubeUnavailable``)."""
    host = _host(server)
    causes = _causes(error)
    if error.status and 300 <= error.status < 400:
        return (
            f"Unable to connect to the server {host}: it answered with a redirect, which is "
            "never followed (the credentials would go wherever it points); use the API "
            "server's own address"
        )
    for cause in causes:
        if isinstance(
            cause, ssl.SSLCertVerificationError | aiohttp.ClientConnectorCertificateError
        ):
            detail = getattr(cause, "verify_message", None) or "certificate verify failed"
            return (
                f"Unable to connect to the server {host}: x509: {detail} (check the "
                "kubeconfig's certificate-authority for this cluster)"
            )
        if isinstance(cause, ConnectionRefusedError):
            return (
                f"The connection to the server {host} was refused - did you specify the right "
                "host or port?"
            )
        if isinstance(cause, socket.gaierror):
            return (
                f"Unable to connect to the server: dial tcp: lookup {urlsplit(server).hostname}: "
                "no such host"
            )
        if isinstance(cause, TimeoutError):
            return f"Unable to connect to the server {host}: dial tcp {host}: i/o timeout"
        if isinstance(cause, aiohttp.ServerDisconnectedError | ConnectionResetError):
            return f"Unable to connect to the server {host}: the connection was closed (EOF)"
    if error.status:
        return (
            f"Unable to connect to the server {host}: it answered HTTP {error.status} with "
            "something other than the Kubernetes API (a proxy or load balancer?)"
        )
    return f"Unable to connect to the server {host}: {type(causes[-1]).__name__}"


def kubeconfig_line(error: BaseException, kubeconfig: str | None, context: str | None) -> str:
    """kubectl's line for a kubeconfig that does not give a cluster (the kubernetes client's
    ``ConfigException`` texts mapped to what kubectl says)."""
    text = str(error)
    if kubeconfig is not None and not Path(kubeconfig).exists():
        return f"stat {kubeconfig}: no such file or directory"
    if context is not None and f"name {context} in" in text:
        return f'context "{context}" does not exist (kubectl config get-contexts lists them)'
    if any(m in text for m in ("No configuration found", "file is empty", "Expected key")):
        where = kubeconfig or "$KUBECONFIG or ~/.kube/config"
        return (
            f"no configuration has been provided in {where}: pass --kubeconfig FILE or set "
            "KUBECONFIG (kubectl config view shows what kubectl would use)"
        )
    first = text.splitlines()[0] if text else type(error).__name__
    return f"error loading the kubeconfig: {first[:200]}"
