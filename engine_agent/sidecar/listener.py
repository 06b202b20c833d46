"""Where and how the agent listens: the pod IP (never a wildcard), TLS whose certificate is
reloaded when its files change, and a server that bounds slow and numerous clients.

The address is parsed, not compared as text, so every spelling of the wildcard (``0``,
``0x0``, ``0.0``, ``::0``, ``::ffff:0.0.0.0`` …) is refused, and a name is refused when any of
its addresses is one. A request head must arrive within ``header_timeout`` and at most
``max_connections`` connections are served at once (:class:`~engine_agent.sidecar.app.HttpLimits`;
the body timeout is the app's).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import ssl

from aiohttp import web

from engine_agent.sidecar.app import HttpLimits

__all__ = ["ReloadingTLS", "listen_host", "serve", "tls_context"]


async def serve(
    app: web.Application,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    limits: HttpLimits,
) -> None:
    """Serve ``app`` until SIGTERM or SIGINT, then shut down cleanly (the agent stops).

    Within :class:`HttpLimits`: a connection must send a whole request head within
    ``header_timeout`` of opening (or of its previous answer), else aiohttp closes it (its
    idle-connection timer; a partly sent head counts as idle); a TLS handshake gets as long;
    beyond ``max_connections`` open connections a new one is closed at once.
    """
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.header_timeout)
    await runner.setup()
    try:
        server = runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        # Accepted but not yet in ``server.connections`` (asyncio announces a connection one
        # loop turn after accepting it, and a TLS one after its handshake, which the header
        # timeout bounds instead): a burst of connects must not slip past the bound.
        burst = 0

        def settle() -> None:
            nonlocal burst
            burst = 0

        def accept() -> asyncio.BaseProtocol:
            nonlocal burst
            if len(server.connections) + burst >= limits.max_connections:
                return _Refused()
            if burst == 0:
                loop.call_soon(settle)
            burst += 1
            return server()

        listener = await loop.create_server(
            accept,
            host,
            port,
            ssl=ssl_context,
            ssl_handshake_timeout=limits.header_timeout if ssl_context else None,
            reuse_address=True,
        )
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            listener.close()
    finally:
        await runner.cleanup()


class _Refused(asyncio.Protocol):
    """A connection over ``max_connections``: closed as soon as it is accepted."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address if it is one in any spelling the resolver accepts: standard
    forms, and the short IPv4 forms of ``inet_aton`` (``0``, ``0x0``, ``0.0``, ``127.1``)."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        pass
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _unspecified(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_unspecified
    return address.is_unspecified


def listen_host(host: str | None) -> str:
    """The address to listen on: an explicit host or the pod IP, never a wildcard.

    The address is parsed, not compared as text: ``0``, ``0x0``, ``0.0``, ``::0``,
    ``0:0:0:0:0:0:0:0`` are the wildcard too. A name is resolved and refused if any of its
    addresses is a wildcard.

    Raises:
        ValueError: no address given, a wildcard (which would also expose the agent on
            every other interface of the pod), or a name that does not resolve.
    """
    text = (host or "").strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    refusal = ValueError(
        f"--host {host!r}: listen on the pod IP (set POD_IP from the downward API, "
        "fieldRef status.podIP), never on a wildcard address"
    )
    if not text or text == "*":
        raise refusal
    address = _address(text)
    if address is not None:
        addresses = [address]
    else:
        try:
            found = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as e:
            raise ValueError(f"--host {host!r} does not resolve: {e}") from e
        addresses = [a for info in found if (a := _address(str(info[4][0]))) is not None]
    if not addresses or any(_unspecified(a) for a in addresses):
        raise refusal
    return text


class ReloadingTLS:
    """A server TLS context whose certificate is reloaded when the files change (cert-manager
    renews certificates in place); new handshakes use the new certificate.

    Raises:
        ValueError: only one of the two files is given.
        OSError, ssl.SSLError: at construction, when the pair cannot be loaded.
    """

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._stamp: tuple[float, float] | None = None
        self.reload()
        self.context.sni_callback = lambda *_: self.reload()

    def reload(self) -> None:
        try:
            stamp = (os.stat(self.cert_file).st_mtime, os.stat(self.key_file).st_mtime)
            if stamp != self._stamp:
                self.context.load_cert_chain(self.cert_file, self.key_file)
                self._stamp = stamp
        except (OSError, ssl.SSLError):
            if self._stamp is None:
                raise
            logging.getLogger(__name__).exception("Kept the previous TLS certificate")


def tls_context(cert_file: str | None, key_file: str | None) -> ReloadingTLS | None:
    """TLS for the agent port when both files are given; plain HTTP when neither is."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    return ReloadingTLS(cert_file, key_file)
