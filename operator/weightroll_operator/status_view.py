"""``weightroll status NAME``: a WeightUpdate's phase, per-pod table, conditions and last events.

A CI pipeline can gate on it: the exit status says how the rollout ended (:class:`Exit`), and
``--watch`` polls until it ends (a terminal phase for the spec's current generation) or
``--timeout`` passes. ``-o json|yaml`` prints one document, a
:class:`~weightroll_operator.status_document.StatusView` (its JSON Schema and the table in
docs/api.md are generated from that model); without ``-o`` the text view.

Fail closed: a phase counts only when ``status.observedGeneration`` equals
``metadata.generation``. Right after ``kubectl apply`` of a new ``spec.version`` the status still
describes the previous spec (``Succeeded`` for the old version); that is "not finished", never
success.

Reads only (the WeightUpdate and its Events); :func:`render`, :func:`view` and :func:`outcome` are
pure and tested on their own (``tests/unit/weightroll_operator/test_status_view.py`` holds golden
texts for a running, a failed and a succeeded update).

Errors are one line on stderr that says how to fix them: exit 2 when no kubeconfig can be
loaded, 1 when the API server cannot be reached or answers with an error (e.g. an unknown name).
The target arguments (the namespace defaults to the kubeconfig context's, as kubectl's), the
kubeconfig loading and those error lines are shared with the ``weightroll pause|resume|promote``
verbs (``control.py``), so every command names a cluster and explains a failure the same way.

Limitations: ``--watch`` polls (``--interval``, 2 s) instead of opening a watch stream; a phase
that lasts less than one interval may not be printed as a progress line (the final one always is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from pathlib import Path
from typing import Any, cast

import yaml

from weightroll_operator.api.names import is_dns_label, is_dns_subdomain
from weightroll_operator.errors import KubeError, KubeNotFound, KubeUnavailable
from weightroll_operator.k8s.client import KubeApi, KubeConfig
from weightroll_operator.k8s.describe import kubeconfig_line, unreachable_line
from weightroll_operator.status_document import (
    SCHEMA_VERSION,
    ConditionStatus,
    ExitCode,
    Result,
    StatusView,
    ViewCondition,
    ViewEvent,
    ViewPod,
    ViewReplicas,
)

__all__ = [
    "Exit",
    "add_target_arguments",
    "context_namespace",
    "kube_error_line",
    "load_config",
    "main",
    "outcome",
    "render",
    "target_namespace",
    "view",
]

_DESCRIPTION = (
    "Show one WeightUpdate: phase, version, replica counts, conditions, the per-pod table "
    "(failed pods always listed, with their reason) and the most recent Events. Read-only."
)
_EPILOG = (
    "Credentials: --kubeconfig, else the ServiceAccount when run in a pod, else $KUBECONFIG or "
    "~/.kube/config (as kubectl). Exit status: 0 Succeeded, 1 the API server could not be "
    "reached or answered with an error (e.g. no such WeightUpdate), 2 bad usage or no "
    "kubeconfig, 3 Failed or RolledBack, 4 not finished (any other phase, a status about an "
    "older generation, or --watch timed out). A phase counts only once the operator has "
    "reported on the current generation of the spec."
)


class Exit(IntEnum):
    """Exit statuses of ``weightroll status`` (the epilog states them)."""

    SUCCEEDED = 0
    API_ERROR = 1
    USAGE = 2
    #: ``Failed`` (halted, deadline, invalid spec) or ``RolledBack``: the version is not served.
    FAILED = 3
    #: Not finished: Pending, Progressing, Paused, RollingBack, a stale status, or a timeout.
    NOT_FINISHED = 4


#: Phases that end a rollout, and the exit status each means.
TERMINAL: dict[str, Exit] = {
    "Succeeded": Exit.SUCCEEDED,
    "Failed": Exit.FAILED,
    "RolledBack": Exit.FAILED,
}
_COUNTS = ("total", "updated", "verified", "draining", "failed", "stale")


def _current(body: Mapping[str, Any]) -> bool:
    """Whether the status is about the spec as it is now (its generation was observed)."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    observed, generation = status.get("observedGeneration"), meta.get("generation")
    return observed is not None and (generation is None or observed == generation)


def outcome(body: Mapping[str, Any]) -> Exit:
    """How the rollout of ``body`` stands for a pipeline: success, failure or not finished.

    A terminal phase counts only when the status is about the current generation, so a status
    left over from a previous ``spec.version`` never reads as this version's success.
    """
    if not _current(body):
        return Exit.NOT_FINISHED
    phase = str((body.get("status") or {}).get("phase") or "Pending")
    return TERMINAL.get(phase, Exit.NOT_FINISHED)


_FORBIDDEN = "; your user may not get weightupdates.weightroll.io or list events in this namespace"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def _section(rows: list[list[str]], header: list[str]) -> list[str]:
    """An indented table, or ``(none)`` when there is no row."""
    return ["  " + x for x in _table(rows, header)] if rows else ["  (none)"]


def render(body: Mapping[str, Any], events: Sequence[Mapping[str, Any]], last: int = 10) -> str:
    """The text shown by ``weightroll status`` for one WeightUpdate object and its Events."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    status = body.get("status") or {}
    replicas = status.get("replicas") or {}
    lines = [
        f"Name:      {meta.get('namespace')}/{meta.get('name')}",
        f"Version:   {spec.get('version')}  (stable: {status.get('stableVersion') or '-'})",
        f"Phase:     {status.get('phase', 'Pending')}",
        f"Message:   {status.get('message') or _no_status(status)}",
        "Replicas:  "
        + ", ".join(
            f"{k} {replicas.get(k, 0)}"
            for k in ("total", "updated", "verified", "draining", "failed", "stale")
        ),
        "",
        "Conditions:",
    ]
    conds = [
        [c.get("type", ""), c.get("status", ""), c.get("reason", ""), c.get("message", "")[:80]]
        for c in status.get("conditions") or []
    ]
    lines += _section(conds, ["TYPE", "STATUS", "REASON", "MESSAGE"])
    pod_list = status.get("pods") or []
    # The UNIT column only when pods are grouped (spec.groupBy): the unit is then the group.
    units = any(p.get("unit") for p in pod_list)
    # The STEP column only while some pod is being worked on (prefetching ... verifying): once
    # every listed pod is Ready (or has no step) it would only repeat STATE.
    steps = any(p.get("step") not in (None, "Ready") for p in pod_list)
    pods = [
        [
            p.get("name", ""),
            *([p.get("unit") or "-"] if units else []),
            p.get("state", ""),
            *([p.get("step") or "-"] if steps else []),
            p.get("version") or "-",
            p.get("reason") or "",
        ]
        for p in pod_list
    ]
    header = [
        "POD",
        *(["UNIT"] if units else []),
        "STATE",
        *(["STEP"] if steps else []),
        "VERSION",
        "REASON",
    ]
    lines += ["", "Pods:", *_section(pods, header)]
    recent = sorted(events, key=lambda e: str(e.get("lastTimestamp") or ""))[-last:]
    rows = [
        [
            str(e.get("lastTimestamp") or ""),
            str(e.get("type") or ""),
            str(e.get("reason") or ""),
            str(e.get("message") or "")[:100],
        ]
        for e in recent
    ]
    lines += ["", "Events:", *_section(rows, ["TIME", "TYPE", "REASON", "MESSAGE"])]
    return "\n".join(lines)


_RESULT: dict[Exit, Result] = {
    Exit.SUCCEEDED: "Succeeded",
    Exit.FAILED: "Failed",
    Exit.NOT_FINISHED: "NotFinished",
}


def view(
    body: Mapping[str, Any], events: Sequence[Mapping[str, Any]], last: int = 10
) -> dict[str, Any]:
    """The document ``weightroll status -o json|yaml`` prints (a validated :class:`StatusView`)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    status = body.get("status") or {}
    replicas = status.get("replicas") or {}
    code = outcome(body)
    recent = sorted(events, key=lambda e: str(e.get("lastTimestamp") or ""))[-last:] if last else []
    document = StatusView(
        schema_version=SCHEMA_VERSION,
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        version=spec.get("version"),
        generation=meta.get("generation"),
        observed_generation=status.get("observedGeneration"),
        current=_current(body),
        phase=str(status.get("phase") or "Pending"),
        result=_RESULT[code],
        # outcome() returns only 0, 3 or 4; the model checks it again.
        exit_code=cast(ExitCode, int(code)),
        message=str(status.get("message") or ""),
        stable_version=status.get("stableVersion"),
        replicas=ViewReplicas(**{k: int(replicas.get(k) or 0) for k in _COUNTS}),
        conditions=[_condition(c) for c in status.get("conditions") or []],
        pods=[_pod(p) for p in status.get("pods") or []],
        events=[_event(e) for e in recent],
    )
    return document.to_document()


def _condition(c: Mapping[str, Any]) -> ViewCondition:
    return ViewCondition(
        type=str(c.get("type") or ""),
        # What the API server holds (the CRD enumerates it); the model checks it again.
        status=cast(ConditionStatus, str(c.get("status") or "Unknown")),
        reason=str(c.get("reason") or ""),
        message=str(c.get("message") or ""),
        last_transition_time=c.get("lastTransitionTime"),
    )


def _pod(p: Mapping[str, Any]) -> ViewPod:
    return ViewPod(
        name=str(p.get("name") or ""),
        state=str(p.get("state") or ""),
        version=p.get("version"),
        reason=p.get("reason"),
        unit=p.get("unit"),
        step=p.get("step"),
    )


def _event(e: Mapping[str, Any]) -> ViewEvent:
    return ViewEvent(
        time=e.get("lastTimestamp"),
        type=str(e.get("type") or ""),
        reason=str(e.get("reason") or ""),
        message=str(e.get("message") or ""),
        count=int(e.get("count") or 1),
    )


def progress_line(body: Mapping[str, Any]) -> str:
    """One line per observed change while ``--watch`` waits: phase, counts, message."""
    status = body.get("status") or {}
    replicas = status.get("replicas") or {}
    stale = "" if _current(body) else " (status of an older generation)"
    return (
        f"{status.get('phase') or 'Pending'}{stale}: "
        f"{replicas.get('updated', 0)}/{replicas.get('total', 0)} updated, "
        f"{replicas.get('verified', 0)} verified, {replicas.get('failed', 0)} failed"
        f"{' - ' + status['message'] if status.get('message') else ''}"
    )


def _no_status(status: Mapping[str, Any]) -> str:
    return "" if status else "no status yet: is the weightroll operator running?"


async def _fetch(api: KubeApi, namespace: str, name: str) -> tuple[Any, list[Any]]:
    try:
        body = await api.get_weightupdate(namespace, name)
        events = await api.list_events(namespace, name)
        return body, events
    finally:
        await api.close()


async def _watch(
    api: KubeApi,
    namespace: str,
    name: str,
    *,
    timeout: float | None,
    interval: float,
    report: Callable[[str], None],
) -> tuple[Any, list[Any], bool]:
    """Poll until :func:`outcome` is final or ``timeout`` seconds pass.

    Each change of what :func:`progress_line` shows is reported as one line. The API server
    being briefly unreachable does not end the watch (reported, retried); any other API error
    does.

    Returns:
        The last object read, its Events, and whether the watch timed out.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    seen: str | None = None
    body: Any = None
    try:
        while True:
            try:
                body = await api.get_weightupdate(namespace, name)
            except KubeUnavailable as e:
                if body is None:
                    raise
                report(f"API server unreachable, retrying: {e}")
            else:
                line = progress_line(body)
                if line != seen:
                    seen = line
                    report(line)
                if outcome(body) is not Exit.NOT_FINISHED:
                    return body, await api.list_events(namespace, name), False
            if deadline is not None and time.monotonic() >= deadline:
                return body, await api.list_events(namespace, name), True
            pause = interval if deadline is None else min(interval, deadline - time.monotonic())
            await asyncio.sleep(max(pause, 0.0))
    finally:
        await api.close()


_UNAUTHORIZED = "; the kubeconfig's credentials were refused: refresh them (kubectl get wu works?)"


def _not_found(error: KubeNotFound, namespace: str, name: str) -> str:
    """One line for a 404: the object is missing, or the CRD itself is not installed."""
    if "could not find the requested resource" in str(error):
        return (
            "the API server does not serve weightupdates.weightroll.io; install the CRD "
            "(helm install weightroll charts/weightroll, or kubectl apply -f crds/)"
        )
    return (
        f"WeightUpdate {namespace}/{name} not found; list them with "
        f"`kubectl get weightupdates -n {namespace}` (or -A), or pass -n NAMESPACE"
    )


def kube_error_line(
    error: KubeError, server: str, namespace: str, name: str, *, forbidden: str
) -> str:
    """The one line (without the ``weightroll VERB:`` prefix) that explains a failed API call.

    Args:
        error: what the client raised.
        server: the API server's URL, named when it cannot be reached.
        namespace: namespace of the WeightUpdate.
        name: name of the WeightUpdate.
        forbidden: the hint appended to a 403, naming what the caller's user must be allowed.

    Returns:
        The cause and its fix: not found (or no CRD), unreachable, 401, 403, or the API's message.
    """
    if isinstance(error, KubeNotFound):
        return _not_found(error, namespace, name)
    if isinstance(error, KubeUnavailable):
        return unreachable_line(error, server)
    if error.status == 401:
        return "You must be logged in to the server (Unauthorized)" + _UNAUTHORIZED
    hint = {403: forbidden}.get(error.status, "")
    return f"{error}{hint}"


def load_config(prog: str, kubeconfig: str | None, context: str | None) -> KubeConfig | None:
    """The cluster to talk to, or ``None`` after printing one line on stderr saying why not.

    Args:
        prog: the command, e.g. ``weightroll status``, that prefixes the error line.
        kubeconfig: ``--kubeconfig``; ``None`` for in-cluster, then ``$KUBECONFIG``.
        context: ``--context``; ``None`` for the current context.
    """
    try:
        return KubeConfig.load(kubeconfig, context)
    except Exception as e:  # kubernetes' ConfigException, OSError, ...: all mean "no cluster"
        print(f"{prog}: {kubeconfig_line(e, kubeconfig, context)}", file=sys.stderr)
        return None


_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def context_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace kubectl would use without ``-n``: the context's, else ``default``.

    In a pod (no ``--kubeconfig``, ``KUBERNETES_SERVICE_HOST`` set) it is the ServiceAccount's
    namespace, as for :meth:`KubeConfig.load`.

    Args:
        kubeconfig: ``--kubeconfig``; ``None`` for in-cluster, then ``$KUBECONFIG``.
        context: ``--context``; ``None`` for the current context.
    """
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        try:
            return _SA_NAMESPACE.read_text().strip() or "default"
        except OSError:
            return "default"
    from kubernetes import config  # deferred: only needed for kubeconfig parsing

    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)  # type: ignore[no-untyped-call]
    except Exception:  # the kubeconfig was loadable a moment ago; "default" as kubectl would
        return "default"
    chosen = (
        active if context is None else next((c for c in contexts if c["name"] == context), None)
    )
    namespace = ((chosen or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else "default"


def target_namespace(args: argparse.Namespace) -> str:
    """``-n`` if given, else :func:`context_namespace` of ``--kubeconfig``/``--context``."""
    if args.namespace:
        return str(args.namespace)
    return context_namespace(args.kubeconfig, args.context)


def _object_name(value: str) -> str:
    """argparse type: a Kubernetes object name (it becomes a URL path segment)."""
    if not is_dns_subdomain(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a Kubernetes object name")
    return value


def _namespace_name(value: str) -> str:
    if not is_dns_label(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a namespace name")
    return value


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """``NAME``, ``-n/--namespace``, ``--kubeconfig`` and ``--context``: which WeightUpdate.

    The namespace is resolved with :func:`target_namespace` (``-n`` is ``None`` when omitted).
    """
    parser.add_argument(
        "name",
        metavar="NAME",
        type=_object_name,
        help="name of the WeightUpdate (kubectl get wu)",
    )
    parser.add_argument(
        "-n",
        "--namespace",
        default=None,
        type=_namespace_name,
        help="namespace of the WeightUpdate (default: the kubeconfig context's namespace, "
        "else default; in a pod, the ServiceAccount's)",
    )
    parser.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)",
    )
    parser.add_argument("--context", help="kubeconfig context (default: the current context)")


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weightroll status", description=_DESCRIPTION, epilog=_EPILOG)
    add_target_arguments(p)
    p.add_argument(
        "--events", type=int, default=10, metavar="N", help="how many recent Events to show (10)"
    )
    p.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="poll until the rollout ends (Succeeded, Failed or RolledBack for the current "
        "generation), printing one line per change; then show it and exit by its outcome",
    )
    p.add_argument(
        "--timeout",
        type=_positive,
        metavar="S",
        help="with --watch: give up after S seconds (exit 4); implies --watch (default: no limit)",
    )
    p.add_argument(
        "--interval",
        type=_positive,
        default=2.0,
        metavar="S",
        help="with --watch: seconds between polls (2)",
    )
    p.add_argument(
        "-o",
        "--output",
        choices=("text", "json", "yaml"),
        default="text",
        help="text (default), or one json/yaml document (schema: docs/api.md, "
        "'weightroll status -o json'); with --watch the progress lines go to stderr",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Print the view of one WeightUpdate; the exit status is :class:`Exit` (see the epilog)."""
    args = _parser().parse_args(list(argv or []))
    config = load_config("weightroll status", args.kubeconfig, args.context)
    if config is None:
        return Exit.USAGE
    namespace = target_namespace(args)
    machine = args.output != "text"

    def report(line: str) -> None:
        print(line, file=sys.stderr if machine else sys.stdout, flush=True)

    timed_out = False
    try:
        if args.watch or args.timeout is not None:
            body, events, timed_out = asyncio.run(
                _watch(
                    KubeApi(config),
                    namespace,
                    args.name,
                    timeout=args.timeout,
                    interval=args.interval,
                    report=report,
                )
            )
        else:
            body, events = asyncio.run(_fetch(KubeApi(config), namespace, args.name))
    except KubeError as e:
        line = kube_error_line(e, config.server, namespace, args.name, forbidden=_FORBIDDEN)
        print(f"weightroll status: {line}", file=sys.stderr)
        return Exit.API_ERROR
    if args.output == "json":
        print(json.dumps(view(body, events, last=args.events), indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(view(body, events, last=args.events), sort_keys=False), end="")
    else:
        if args.watch or args.timeout is not None:
            print()
        print(render(body, events, last=args.events))
    code = outcome(body)
    if timed_out:
        phase = (body.get("status") or {}).get("phase") or "Pending"
        print(
            f"weightroll status: timed out after {args.timeout:g} s; {namespace}/{args.name} "
            f"is still {phase} (exit {int(Exit.NOT_FINISHED)})",
            file=sys.stderr,
        )
    return int(code)
