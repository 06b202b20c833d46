"""``weightroll-agent``: parse flags and environment, then serve the sidecar until stopped.

Every flag has an environment variable (``WEIGHTROLL_AGENT_*``) so the Helm chart can configure
the container without templating the command line; a flag wins over its variable. The process
refuses to start without a readable, non-empty token file or with a non-loopback vLLM URL.

It listens on the pod IP only (``--host``, default ``$POD_IP`` from the downward API), never on a
wildcard address (however spelled: ``0``, ``0x0``, ``0.0``, ``::0`` …), and serves TLS when
given a certificate and key (a mounted Secret, e.g. from cert-manager or the chart's self-signed
CA); the certificate is re-read when its file changes. Slow clients are bounded: a request head
must arrive within ``--header-timeout``, a body within ``--body-timeout``, and at most
``--max-connections`` connections are served at once.

Trainer pushes (the native weight-transfer routes) need two more settings, both empty by
default, which keeps them refused: ``--trainer-networks`` (where a rendezvous peer may be) and
``--trainer-token-file`` (the trainers' own tokens, sharing none with ``--token-file``).

``--manifest-public-key`` makes every update's manifest carry a signature by that key
(``engine_agent.sidecar.signing``); a key that cannot be read or used, or a missing
``model-signing`` package, stops the agent at start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Final, NoReturn

from annotated_types import Ge, Gt, Le
from pydantic import BeforeValidator, Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine_agent.protocol import SourceSpec
from engine_agent.sidecar.agent import Agent
from engine_agent.sidecar.app import HttpLimits, TokenFile, create_app
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.engine import require_loopback
from engine_agent.sidecar.listener import listen_host, serve, tls_context
from engine_agent.sidecar.signing import ManifestVerifier
from engine_agent.transfer.rendezvous import Network, parse_networks

__all__ = ["DEFAULT_PORT", "AgentSettings", "build_config", "main", "parse_args"]

#: Agent port (container port name ``weightroll``, docs/contracts.md).
DEFAULT_PORT: Final = 8470
#: Prefix of every setting's variable.
ENV_PREFIX: Final = "WEIGHTROLL_AGENT_"

_CONFIG, _LIMITS = AgentConfig(), HttpLimits()


def _seconds(default: float, meaning: str) -> Any:
    """A finite number of seconds above zero (a zero or negative timeout would end every call,
    or every push, at once; NaN and infinities are refused by the model's ``allow_inf_nan``)."""
    return Field(default, gt=0, description=meaning)


class AgentSettings(BaseSettings):
    """The agent's settings: a flag (a constructor argument), else its ``WEIGHTROLL_AGENT_<NAME>``
    variable (an empty one counts as unset), else the default. The descriptions are the flags'
    help texts; ``_parser`` builds the command line from these fields."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        frozen=True,
        extra="forbid",
        allow_inf_nan=False,
    )

    host: str | None = Field(
        default_factory=lambda: os.environ.get("POD_IP") or None,
        description="listen address: the pod IP, never a wildcard (default $POD_IP)",
    )
    tls_cert_file: str | None = Field(None, description="serve TLS: certificate (PEM)")
    tls_key_file: str | None = Field(None, description="serve TLS: private key (PEM)")
    port: int = Field(
        DEFAULT_PORT, ge=1, le=65535, description=f"listen port (default {DEFAULT_PORT})"
    )
    vllm_url: str = Field(_CONFIG.vllm_url, description="loopback URL of the local vLLM server")
    token_file: str | None = Field(
        None, description="file holding the bearer token for /v1 (a mounted Secret key 'token')"
    )
    state_dir: str | None = Field(
        None, description="directory (emptyDir) where the agent persists its state"
    )
    initial_version: str | None = Field(
        None, description="version vLLM starts with; default: adopt what the ranks report"
    )
    initial_source: str | None = Field(
        None, description="path or file:// URI of the weights vLLM starts with"
    )
    initial_manifest: str | None = Field(
        None,
        description="manifest of --initial-source, as a WeightUpdate names it: the operator "
        "counts a booted pod at the target only when both match spec.source",
    )
    source_root: str | None = Field(
        None, description="resolve weight sources and manifests under this directory"
    )
    model_dir: str | None = Field(
        None,
        description="directory (the model volume's mount path) every update source and "
        "manifest must lie in, symlinks resolved",
    )
    manifest_public_key: str | None = Field(
        None,
        description="PEM public key (EC) every update's manifest must be signed with: "
        "<manifest>.sig, an OpenSSF model-signing bundle; needs the model-signing package",
    )
    max_connections: int = Field(
        _LIMITS.max_connections,
        ge=1,
        description="connections served at once; more are closed on accept",
    )
    trainer_token_file: str | None = Field(
        None,
        description="file holding the trainers' bearer tokens, one per line: the only tokens "
        "the native weight-transfer routes accept (unset: those routes are closed)",
    )
    #: Not JSON (``NoDecode``): the variable is the list as written, parsed by ``parse_networks``.
    trainer_networks: Annotated[tuple[Network, ...], NoDecode, BeforeValidator(parse_networks)] = (
        Field(
            (),
            description="IP networks (CIDR, comma separated) a trainer's rendezvous address "
            "(init_info.master_address) may lie in; empty refuses every trainer push",
        )
    )
    header_timeout: float = _seconds(
        _LIMITS.header_timeout, "seconds a connection may take to send a request head"
    )
    body_timeout: float = _seconds(
        _LIMITS.body_timeout, "seconds a request may take to send its body"
    )
    begin_timeout: float = _seconds(_CONFIG.begin_timeout, "seconds for weightroll_begin")
    load_timeout: float = _seconds(_CONFIG.load_timeout, "seconds for weightroll_load")
    finish_timeout: float = _seconds(_CONFIG.finish_timeout, "seconds for weightroll_finish")
    control_timeout: float = _seconds(_CONFIG.control_timeout, "seconds for weightroll_state/abort")
    abort_pause_timeout: float = _seconds(
        _CONFIG.abort_pause_timeout, "seconds for /pause?mode=abort"
    )
    watch_interval: float = _seconds(_CONFIG.watch_interval, "seconds between guard passes")
    push_idle_timeout: float = _seconds(
        _CONFIG.push_idle_timeout, "seconds a trainer push may stay open without a call"
    )
    log_level: str = Field("INFO", description="logging level")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parser() -> argparse.ArgumentParser:
    """The command line: one flag per :class:`AgentSettings` field, its help the field's
    description and variable. Flags default to ``None`` (not given: the variable or default)."""
    parser = argparse.ArgumentParser(
        prog="weightroll-agent",
        description="Serve the pod sidecar that drives one vLLM replica through verified updates.",
    )
    for name, field in AgentSettings.model_fields.items():
        parser.add_argument(_flag(name), help=f"{field.description} [{name.upper()}]")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> AgentSettings:
    """The settings from ``argv`` (default ``sys.argv[1:]``) and the ``WEIGHTROLL_AGENT_*``
    variables; a value out of its range exits 2 with one line naming its flag or variable."""
    parser = _parser()
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    try:
        return AgentSettings(**given)
    except ValidationError as e:
        _refuse(parser, e, given)


def _refuse(
    parser: argparse.ArgumentParser, error: ValidationError, flags: Mapping[str, Any]
) -> NoReturn:
    problems: dict[str, None] = {}
    for problem in error.errors():
        name = str(problem["loc"][0]) if problem["loc"] else ""
        where = _flag(name) if name in flags else f"{ENV_PREFIX}{name.upper()}"
        field = AgentSettings.model_fields.get(name)
        if problem["type"] == "value_error":  # a validator's own message (the networks)
            accepts = str(problem["ctx"]["error"])
        else:
            accepts = f"must be {_accepts(field)}" if field else problem["msg"]
        problems[f"{where}={problem['input']!r}: {accepts}"] = None
    parser.error("; ".join(problems))


def _accepts(field: FieldInfo) -> str:
    """What ``field`` accepts, from its type and constraints."""
    gt = next((m.gt for m in field.metadata if isinstance(m, Gt)), None)
    ge = next((m.ge for m in field.metadata if isinstance(m, Ge)), None)
    le = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    if le is not None:
        return f"a TCP port ({ge}-{le})"
    if field.annotation is float:
        return f"a finite number of seconds above {gt:g} (e.g. 30; {field.description})"
    return f"a whole number at least {ge} ({field.description})"


def build_config(args: AgentSettings) -> AgentConfig:
    """Turn the settings into an :class:`AgentConfig` (validates URL and source)."""
    require_loopback(args.vllm_url)
    if args.model_dir and not args.model_dir.startswith("/"):
        raise ValueError(f"--model-dir {args.model_dir!r} must be an absolute path")
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
        model_dir=args.model_dir or None,
        trainer_networks=args.trainer_networks,
        trainer_token_file=Path(args.trainer_token_file) if args.trainer_token_file else None,
        manifest_public_key=Path(args.manifest_public_key) if args.manifest_public_key else None,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sidecar; returns 2 on bad configuration (never returns otherwise)."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.token_file:
        print(
            "weightroll-agent: --token-file (or WEIGHTROLL_AGENT_TOKEN_FILE) is required",
            file=sys.stderr,
        )
        return 2
    try:
        config = build_config(args)
        tokens = TokenFile(args.token_file)
        if config.trainer_token_file is not None:
            _separate_tokens(args.token_file, config.trainer_token_file)
        if config.manifest_public_key is not None:
            ManifestVerifier.load(config.manifest_public_key)  # SigningUnavailable: exit 2
    except ValueError as e:
        print(f"weightroll-agent: {e}", file=sys.stderr)
        return 2
    try:
        host = listen_host(args.host)
        tls = tls_context(args.tls_cert_file, args.tls_key_file)
    except (ValueError, OSError) as e:
        print(f"weightroll-agent: {e}", file=sys.stderr)
        return 2
    limits = HttpLimits(
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
    )
    app = create_app(Agent(config), tokens, limits=limits)
    asyncio.run(serve(app, host, args.port, None if tls is None else tls.context, limits))
    return 0


def _separate_tokens(operator_file: str, trainer_file: Path) -> None:
    """The trainer token file must be readable, non-empty and share no token with the
    operator's: one credential must never open both the ``/v1`` and the trainer routes.

    Raises:
        ValueError: naming the files (never the tokens).
    """
    TokenFile(trainer_file)  # readable and non-empty, or ValueError

    def lines(path: str | Path) -> set[str]:
        return {line.strip() for line in Path(path).read_text().splitlines() if line.strip()}

    if lines(operator_file) & lines(trainer_file):
        raise ValueError(
            f"--trainer-token-file {str(trainer_file)!r} shares a token with --token-file "
            f"{operator_file!r}: give trainers their own token (a second Secret)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
