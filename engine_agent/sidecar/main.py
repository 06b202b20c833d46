"""``weightroll agent``: parse flags and environment, then serve the sidecar until stopped.

Every flag has an environment variable (``WEIGHTROLL_AGENT_*``) so the Helm chart can configure
the container without templating the command line; a flag wins over its variable. The process
refuses to start without a readable, non-empty token file or with a non-loopback vLLM URL.

It listens on the pod IP only (``--host``, default ``$POD_IP`` from the downward API), never on a
wildcard address, and serves TLS when given a certificate and key (a mounted Secret, e.g. from
cert-manager or the chart's self-signed CA); the certificate is re-read when its file changes.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import ssl
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from aiohttp import web

from engine_agent.protocol import SourceSpec
from engine_agent.sidecar.agent import Agent, AgentConfig
from engine_agent.sidecar.app import TokenFile, create_app
from engine_agent.sidecar.engine import require_loopback

__all__ = ["DEFAULT_PORT", "ReloadingTLS", "build_config", "listen_host", "main", "tls_context"]

#: Agent port (container port name ``weightroll``, docs/contracts.md).
DEFAULT_PORT: Final = 8470


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"WEIGHTROLL_AGENT_{name}", default)


def _positive_seconds(env: str) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of seconds above zero (a zero or negative timeout
    would end every call, or every push, at once)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a number of seconds above 0 (e.g. 30); "
                f"it comes from the flag or from WEIGHTROLL_AGENT_{env}"
            )
        return value

    return parse


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a TCP port (1-65535); it comes from the flag or from "
            "WEIGHTROLL_AGENT_PORT"
        )
    return port


def _parser() -> argparse.ArgumentParser:
    defaults = AgentConfig()
    parser = argparse.ArgumentParser(
        prog="weightroll agent",
        description="Serve the pod sidecar that drives one vLLM replica through verified updates.",
    )
    add = parser.add_argument
    add(
        "--host",
        default=_env("HOST", os.environ.get("POD_IP")),
        help="listen address: the pod IP, never a wildcard [HOST; default $POD_IP]",
    )
    add("--tls-cert-file", default=_env("TLS_CERT_FILE"), help="serve TLS: certificate (PEM)")
    add("--tls-key-file", default=_env("TLS_KEY_FILE"), help="serve TLS: private key (PEM)")
    add(
        "--port",
        type=_port,
        # a string default goes through ``type`` too: a bad variable is reported like a bad flag
        default=_env("PORT", str(DEFAULT_PORT)),
        help=f"listen port [PORT] (default {DEFAULT_PORT})",
    )
    add(
        "--vllm-url",
        default=_env("VLLM_URL", defaults.vllm_url),
        help="loopback URL of the local vLLM server [VLLM_URL]",
    )
    add(
        "--token-file",
        default=_env("TOKEN_FILE"),
        help="file holding the bearer token for /v1 (a mounted Secret key 'token') [TOKEN_FILE]",
    )
    add(
        "--state-dir",
        default=_env("STATE_DIR"),
        help="directory (emptyDir) where the agent persists its state [STATE_DIR]",
    )
    add(
        "--initial-version",
        default=_env("INITIAL_VERSION"),
        help="version vLLM starts with; default: adopt what the ranks report [INITIAL_VERSION]",
    )
    add(
        "--initial-source",
        default=_env("INITIAL_SOURCE"),
        help="path or file:// URI of the weights vLLM starts with [INITIAL_SOURCE]",
    )
    add(
        "--initial-manifest",
        default=_env("INITIAL_MANIFEST"),
        help="manifest of --initial-source, as a WeightUpdate names it: the operator counts a "
        "booted pod at the target only when both match spec.source [INITIAL_MANIFEST]",
    )
    add(
        "--source-root",
        default=_env("SOURCE_ROOT"),
        help="resolve weight sources and manifests under this directory [SOURCE_ROOT]",
    )
    for name, help_text in (
        ("begin_timeout", "seconds for weightroll_begin"),
        ("load_timeout", "seconds for weightroll_load"),
        ("finish_timeout", "seconds for weightroll_finish"),
        ("control_timeout", "seconds for weightroll_state/abort"),
        ("abort_pause_timeout", "seconds for /pause?mode=abort"),
        ("watch_interval", "seconds between guard passes"),
        ("push_idle_timeout", "seconds a trainer push may stay open without a trainer call"),
    ):
        env = name.upper()
        add(
            f"--{name.replace('_', '-')}",
            type=_positive_seconds(env),
            default=_env(env) or str(getattr(defaults, name)),
            help=f"{help_text} [{env}]",
        )
    add("--log-level", default=_env("LOG_LEVEL", "INFO"), help="logging level [LOG_LEVEL]")
    return parser


def build_config(args: argparse.Namespace) -> AgentConfig:
    """Turn parsed arguments into an :class:`AgentConfig` (validates URL and source)."""
    require_loopback(args.vllm_url)
    if args.initial_manifest and not args.initial_source:
        raise ValueError("--initial-manifest needs --initial-source (the weights it describes)")
    source = (
        None
        if not args.initial_source
        else SourceSpec(uri=args.initial_source, manifest=args.initial_manifest or None)
    )
    return AgentConfig(
        vllm_url=args.vllm_url,
        begin_timeout=args.begin_timeout,
        load_timeout=args.load_timeout,
        finish_timeout=args.finish_timeout,
        control_timeout=args.control_timeout,
        abort_pause_timeout=args.abort_pause_timeout,
        watch_interval=args.watch_interval,
        push_idle_timeout=args.push_idle_timeout,
        state_dir=Path(args.state_dir) if args.state_dir else None,
        initial_source=source,
        initial_version=args.initial_version,
        source_root=Path(args.source_root) if args.source_root else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sidecar; returns 2 on bad configuration (never returns otherwise)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.token_file:
        print(
            "weightroll agent: --token-file (or WEIGHTROLL_AGENT_TOKEN_FILE) is required",
            file=sys.stderr,
        )
        return 2
    try:
        config = build_config(args)
        tokens = TokenFile(args.token_file)
    except ValueError as e:
        print(f"weightroll agent: {e}", file=sys.stderr)
        return 2
    try:
        host = listen_host(args.host)
        tls = tls_context(args.tls_cert_file, args.tls_key_file)
    except (ValueError, OSError) as e:
        print(f"weightroll agent: {e}", file=sys.stderr)
        return 2
    app = create_app(Agent(config), tokens)
    ssl_context = None if tls is None else tls.context
    web.run_app(
        app, host=host, port=args.port, ssl_context=ssl_context, print=None, access_log=None
    )
    return 0


_WILDCARDS: Final = frozenset({"0.0.0.0", "::", "[::]", "*", ""})


def listen_host(host: str | None) -> str:
    """The address to listen on: an explicit host or the pod IP, never a wildcard.

    Raises:
        ValueError: no address given, or a wildcard (which would also expose the agent on
            every other interface of the pod).
    """
    if host is None or host.strip() in _WILDCARDS:
        raise ValueError(
            f"--host {host!r}: listen on the pod IP (set POD_IP from the downward API, "
            "fieldRef status.podIP), never on a wildcard address"
        )
    return host.strip()


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


if __name__ == "__main__":
    raise SystemExit(main())
