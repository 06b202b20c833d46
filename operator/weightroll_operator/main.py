"""``weightroll operator``: run the WeightUpdate operator (kopf) in this process.

Builds the clients, the reconciler and the metrics endpoint, registers the handlers and calls
``kopf.run``. Standalone by default (no peering): run one replica, or pass ``--peering NAME
--priority N`` with a distinct priority per replica (equal priorities freeze every replica).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import kopf

from weightroll_operator.agent_client import AgentClient
from weightroll_operator.handlers import Runtime, register
from weightroll_operator.k8s.client import KubeApi, KubeConfig
from weightroll_operator.metrics import Metrics
from weightroll_operator.reconcile import Reconciler
from weightroll_operator.settings import OperatorConfig

__all__ = ["build_runtime", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightroll operator",
        description=(
            "Run the WeightUpdate operator (kopf) in this process. Standalone by default: run one "
            "replica, or pass --peering NAME --priority N with a distinct priority per replica."
        ),
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch a namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument("--interval", type=float, help="seconds between timer passes")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0 disables)")
    p.add_argument("--health-port", type=int, help="liveness port for /healthz (0 disables)")
    p.add_argument("--peering", help="kopf peering name (default: standalone)")
    p.add_argument("--priority", type=int, default=0, help="peering priority (distinct!)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def build_runtime(
    config: OperatorConfig,
    kube: KubeApi,
    metrics: Metrics | None,
    namespaces: Sequence[str] = (),
) -> Runtime:
    agents = AgentClient(
        timeout=config.agent_timeout,
        concurrency=config.concurrency,
        ca_file=config.agent_ca_file or None,
        server_name=config.agent_server_name,
    )
    reconciler = Reconciler(
        kube=kube,
        agents=agents,
        metrics=metrics,
        concurrency=config.concurrency,
        state_ttl=config.state_ttl,
        token_ttl=config.token_ttl,
        poll_interval=config.interval,
    )
    return Runtime(reconciler=reconciler, config=config, namespaces=tuple(namespaces))


#: kopf re-asks for credentials this often, so a rotated token file reaches its watches too.
LOGIN_TTL = timedelta(minutes=5)


def _login(cfg: KubeConfig, kube: KubeApi) -> kopf.ConnectionInfo:
    """kopf's credentials: the same server and identity as the operator's own API client, with
    the token read now (a token file is re-read; kopf logs in again on expiry or a 401)."""
    expiration = datetime.now(tz=UTC) + LOGIN_TTL if cfg.token_file else None
    return kopf.ConnectionInfo(
        server=cfg.server,
        token=kube.current_token(),
        expiration=expiration,
        ca_path=cfg.ca_file,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        insecure=not cfg.verify,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv or []))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = OperatorConfig.from_env(
        interval=args.interval, metrics_port=args.metrics_port, health_port=args.health_port
    )
    try:
        kube_config = KubeConfig.load(args.kubeconfig, args.context)
    except Exception as e:  # the kubernetes client raises several unrelated types here
        print(
            f"weightroll operator: cannot load Kubernetes credentials ({e}); run in a pod with a "
            "ServiceAccount, or pass --kubeconfig FILE (or set $KUBECONFIG)",
            file=sys.stderr,
        )
        return 2
    kube = KubeApi(kube_config)
    metrics = Metrics()
    if config.metrics_port:
        metrics.serve(config.metrics_port, addr=config.metrics_addr)
    registry = kopf.OperatorRegistry()
    runtime = build_runtime(config, kube, metrics, args.namespace)
    register(registry, runtime, login=lambda: _login(kube_config, kube))
    liveness = f"http://0.0.0.0:{config.health_port}/healthz" if config.health_port else None
    kopf.run(
        registry=registry,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        namespaces=args.namespace,
        clusterwide=args.all_namespaces or not args.namespace,
        liveness_endpoint=liveness,
    )
    asyncio.run(kube.close())
    return 0
