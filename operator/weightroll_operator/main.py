"""``weightroll-operator``: run the WeightUpdate operator (kopf) in this process.

Builds the clients, the reconciler and the metrics endpoint, registers the handlers and runs
``kopf.operator``. With ``--leader-elect`` (the chart's default, two replicas) kopf runs only
while this process holds the leader Lease (``k8s/lease.py``); a standby serves its liveness and
the admission webhook meanwhile, and a leader that loses the Lease stops (exit code 1, the
kubelet restarts it as a standby). Without it the process acts at once: run one replica.

One HA mechanism: the Lease. kopf always runs standalone (:func:`kopf_options`): its own peering
(``KopfPeering`` objects, a CRD and RBAC of their own) would be a second, weaker election next to
the Lease, and kopf without ``standalone=True`` looks for peering objects on every start.

The admission webhook (``webhook.py``, ``--webhook-port``) runs in every replica, leader or not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
from aiohttp import web

from weightroll_operator.agent_client import AgentClient
from weightroll_operator.gc_pacing import GcPacer
from weightroll_operator.handlers import Runtime, register
from weightroll_operator.k8s.client import KubeApi, KubeConfig
from weightroll_operator.k8s.describe import kubeconfig_line
from weightroll_operator.k8s.lease import LeaderElector
from weightroll_operator.metrics import Metrics
from weightroll_operator.reconcile import Reconciler
from weightroll_operator.settings import OperatorConfig
from weightroll_operator.webhook import WebhookServer

__all__ = ["build_runtime", "kopf_options", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="weightroll-operator",
        description=(
            "Run the WeightUpdate operator (kopf) in this process. For more than one replica, "
            "pass --leader-elect: only the holder of the leader Lease acts."
        ),
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("-n", "--namespace", action="append", default=[], help="watch a namespace")
    scope.add_argument("-A", "--all-namespaces", action="store_true", help="watch every namespace")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--context", help="kubeconfig context")
    p.add_argument(
        "--interval", type=float, help="seconds between passes when nothing is in flight"
    )
    p.add_argument("--pod-selector", help="label selector of the pod watch (default: every pod)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0 disables)")
    p.add_argument("--health-port", type=int, help="liveness port for /healthz (0 disables)")
    p.add_argument(
        "--leader-elect",
        action="store_true",
        default=None,
        help="act only while holding the leader Lease (run two replicas)",
    )
    p.add_argument("--webhook-port", type=int, help="admission webhook HTTPS port (0 disables)")
    p.add_argument("--webhook-cert-dir", help="directory with the webhook's tls.crt, tls.key")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def kopf_options(namespaces: Sequence[str], all_namespaces: bool) -> dict[str, Any]:
    """``kopf.operator``'s watch scope and HA arguments.

    Args:
        namespaces: ``-n`` values (names or kopf globs); empty with ``-A`` or no ``-n``.
        all_namespaces: ``-A``.

    Returns:
        ``standalone=True`` always (the Lease is the one HA mechanism, so kopf never looks for
        ``KopfPeering`` objects, which the chart neither creates nor grants), the namespaces,
        and ``clusterwide`` when no namespace is named.
    """
    return {
        "standalone": True,
        "namespaces": list(namespaces),
        "clusterwide": all_namespaces or not namespaces,
    }


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
        poll_interval=config.poll_interval,
        idle_interval=config.interval,
        burst=config.burst,
        gc_pacer=GcPacer(interval=config.gc_full_interval),
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


async def _standby(_: web.Request) -> web.Response:
    return web.json_response({"standby": True})


@contextlib.asynccontextmanager
async def _standby_health(port: int) -> AsyncIterator[None]:
    """``/healthz`` while waiting for the Lease (kopf's liveness endpoint takes the port after)."""
    if not port:
        yield
        return
    app = web.Application()
    app.router.add_get("/healthz", _standby)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    try:
        yield
    finally:
        await runner.cleanup()


def _elector(config: OperatorConfig, kube: KubeApi) -> LeaderElector:
    namespace = config.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    return LeaderElector(
        api=kube,
        namespace=namespace,
        name=config.lease_name,
        identity=identity,
        lease_seconds=config.lease_seconds,
        renew_seconds=max(0.5, config.lease_seconds / 7.5),
        renew_deadline=config.lease_seconds * 2 / 3,
    )


async def _serve(
    config: OperatorConfig,
    kube: KubeApi,
    on_acting: Callable[[], None] = lambda: None,
    **kopf_kwargs: Any,
) -> int:
    """Webhook, then (with leader election) the Lease, then kopf; the exit code.

    ``on_acting`` runs when this process starts to act (it holds the Lease, if any): time
    before it was the old leader's or nobody's and never counts against a unit's timers.
    """
    webhook = None
    if config.webhook_port:
        webhook = WebhookServer(
            config.webhook_port,
            Path(config.webhook_cert_dir),
            host=config.webhook_addr,
            injection=config.injection(),
        )
        await webhook.start()
    elector = _elector(config, kube) if config.leader_elect else None
    stop = asyncio.Event()
    holding: asyncio.Task[None] | None = None
    try:
        if elector is not None:
            async with _standby_health(config.health_port):
                await elector.acquire()
            # writes stop when the Lease may be lost, not when kopf's shutdown gets there
            kube.fence = elector.acting_for
            holding = asyncio.create_task(elector.hold())
            holding.add_done_callback(lambda _: stop.set())
        on_acting()
        await kopf.operator(stop_flag=stop, **kopf_kwargs)
        return 1 if holding is not None and holding.done() else 0
    finally:
        if holding is not None and not holding.done():
            holding.cancel()
            if elector is not None:
                await elector.release()
        if webhook is not None:
            await webhook.stop()
        await kube.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = OperatorConfig.from_env(
            interval=args.interval,
            metrics_port=args.metrics_port,
            health_port=args.health_port,
            pod_selector=args.pod_selector,
            leader_elect=args.leader_elect,
            webhook_port=args.webhook_port,
            webhook_cert_dir=args.webhook_cert_dir,
        )
    except ValueError as e:
        print(f"weightroll-operator: {e}", file=sys.stderr)
        return 2
    try:
        kube_config = KubeConfig.load(args.kubeconfig, args.context)
    except Exception as e:  # the kubernetes client raises several unrelated types here
        print(
            f"weightroll-operator: {kubeconfig_line(e, args.kubeconfig, args.context)}; in a "
            "pod it uses its ServiceAccount",
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
    return asyncio.run(
        _serve(
            config,
            kube,
            runtime.reconciler.begin_acting,
            registry=registry,
            liveness_endpoint=liveness,
            **kopf_options(args.namespace, args.all_namespaces),
        )
    )
