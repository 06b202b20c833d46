"""``weightroll pause|resume|promote|abort|retry NAME``: steer a rollout through its intents.

Each verb is one JSON merge patch of a field the operator already honours (``domain/plan/``),
so a verb is exactly the ``kubectl patch`` it replaces — of the spec for ``pause``, ``resume``
and ``promote``, of the status subresource (the persisted halt intents) for ``abort`` and
``retry``:

* ``pause``: ``spec.paused: true``. Units in flight finish (drain, reload, verify, traffic back);
  no new unit starts; the phase becomes ``Paused`` once none is in flight. A rollback
  (``onFailure: Rollback`` after a halt) is not held by it, and a ``Succeeded`` WeightUpdate
  stops updating pods that appear later.
* ``resume``: ``spec.paused: false``; new units start on the operator's next pass, up to the
  canary hold if ``spec.strategy.pauseAfterCanary`` is still true.
* ``promote``: ``spec.strategy.pauseAfterCanary: false``, the end of the canary hold. Refused
  unless the status shows the hold (condition ``Paused``, reason ``CanaryComplete``) for the
  spec's current generation; ``--force`` skips the check. The patch is conditional on the
  ``resourceVersion`` read, so a WeightUpdate that changed in between is not promoted blindly.
* ``abort``: ``status.abortedAt: <now>``, ``status.abortReason: AbortedByUser``. Like any halt:
  units in flight finish, nothing new starts, phase ``Failed`` — or, with ``onFailure:
  Rollback``, the touched pods roll back.
* ``retry``: ``status.abortedAt``/``abortReason`` cleared and ``status.retriedAt: <now>`` (the API
  server's time, from its ``Date`` header, so a skewed CLI clock does not matter). Resumes
  after every kind of halt (``FailureBudgetExceeded``, ``ProgressDeadlineExceeded``,
  ``CanaryFailed``, ``AbortedByUser``, a finished rollback): pods whose attempt failed (or was
  rolled back) before ``retriedAt`` are tried again by fresh attempts, and the progress clock
  restarts.

Invariants: :func:`decide` is pure and alone decides the patch and the line printed; a verb
whose intent already holds sends nothing and exits 0 (idempotent). Time on hold does not count
against ``progressDeadlineSeconds``: the operator restarts the progress clock on the pass that
finds a hold released (``domain/plan/``, ``Persisted.held``).

Limitations: the check reads the status the operator last wrote; it can be up to one pass old.
``abort`` and ``retry`` need ``patch`` on ``weightupdates/status``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from weightroll_operator.api.v1alpha1 import ConditionType, Phase
from weightroll_operator.domain.conditions import Reason, timestamp
from weightroll_operator.errors import KubeConflict, KubeError
from weightroll_operator.k8s.client import KubeApi
from weightroll_operator.status_view import (
    add_target_arguments,
    kube_error_line,
    load_config,
    target_namespace,
)

__all__ = ["VERBS", "Outcome", "Verb", "decide", "main"]


class Verb(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    PROMOTE = "promote"
    ABORT = "abort"
    RETRY = "retry"


#: The subcommands this module serves (``weightroll VERB``), in help order.
VERBS = tuple(v.value for v in Verb)

_DESCRIPTION = {
    Verb.PAUSE: (
        "Pause a WeightUpdate: merge-patch spec.paused=true. Units in flight finish (drain, "
        "reload, verify, traffic back) and no new unit starts; the phase becomes Paused once none "
        "is in flight. A rollback (onFailure: Rollback) is not held. Pausing a paused one changes "
        "nothing."
    ),
    Verb.RESUME: (
        "Resume a paused WeightUpdate: merge-patch spec.paused=false. New units start on the "
        "operator's next pass; the canary hold (spec.strategy.pauseAfterCanary) still applies, "
        "lift it with `weightroll promote`. Time on hold does not count against "
        "spec.strategy.progressDeadlineSeconds. Resuming one that is not paused changes nothing."
    ),
    Verb.PROMOTE: (
        "Promote a WeightUpdate held after its canary: merge-patch "
        "spec.strategy.pauseAfterCanary=false; the remaining units follow, maxUnavailable at a "
        "time. Refused unless its status shows the hold (condition Paused, reason CanaryComplete, "
        "for the current generation); --force skips that check. The patch applies only "
        "to the version of the object that was checked. Promoting a promoted one changes nothing."
    ),
    Verb.ABORT: (
        "Halt a WeightUpdate: merge-patch status.abortedAt=now, status.abortReason="
        "AbortedByUser (status subresource). Units in flight finish, no new unit starts, the "
        "phase becomes Failed; with onFailure: Rollback the touched pods roll back. Aborting a "
        "halted one changes nothing; `weightroll retry` resumes it."
    ),
    Verb.RETRY: (
        "Resume a halted WeightUpdate: merge-patch status.abortedAt=null, abortReason=null, "
        "retriedAt=now (status subresource). Works after every kind of halt "
        "(FailureBudgetExceeded, ProgressDeadlineExceeded, CanaryFailed, AbortedByUser, a "
        "rollback): the pods whose attempt failed or was rolled back are updated again by fresh "
        "attempts and the progress clock restarts. Nothing to retry changes nothing."
    ),
}
_FORCE_HELP = {
    Verb.PROMOTE: (
        "lift the hold even when the status does not show it (the canary, if not done, still "
        "goes first)"
    ),
}
_EPILOG = (
    "Prints one line: what changed and the phase the operator last reported. Credentials: "
    "--kubeconfig, else the ServiceAccount when run in a pod, else $KUBECONFIG or ~/.kube/config "
    "(as kubectl); the user needs get and patch on weightupdates.weightroll.io. Exit status: 0 "
    "changed or nothing to change, 1 refused, or the API server could not be reached or answered "
    "with an error (e.g. no such WeightUpdate), 2 bad usage or no kubeconfig."
)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one verb does to one WeightUpdate, decided from the object as read."""

    #: The line to print: on stdout, or on stderr (without the command prefix) when refused.
    line: str
    #: Fields to merge into ``spec``; ``None`` when nothing is sent (done already, or refused).
    patch: Mapping[str, Any] | None = None
    #: Fields to merge into ``status`` (``abort``, ``retry``), through the status subresource.
    status_patch: Mapping[str, Any] | None = None
    #: Makes the patch conditional on the version that was checked (``promote`` only).
    resource_version: str | None = None
    refused: bool = False

    def __post_init__(self) -> None:
        if self.refused and (self.patch is not None or self.status_patch is not None):
            raise ValueError("a refused verb sends no patch")


def _paused_condition(status: Mapping[str, Any]) -> Mapping[str, Any]:
    for cond in status.get("conditions") or []:
        if cond.get("type") == ConditionType.PAUSED:
            return dict(cond)
    return {}


def _canary_hold_missing(body: Mapping[str, Any]) -> str | None:
    """Why the status does not show a canary hold to promote, or ``None`` when it does."""
    meta, spec, status = (body.get(k) or {} for k in ("metadata", "spec", "status"))
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    target = f"{meta.get('name')} -n {meta.get('namespace')}"
    if spec.get("paused"):
        return f"spec.paused hides the canary hold; run `weightroll resume {target}` first"
    if generation is not None and observed != generation:
        return (
            f"the operator has not reported on generation {generation} yet (status is about "
            f"{observed}); retry in a few seconds"
        )
    cond = _paused_condition(status)
    if cond.get("status") == "True" and cond.get("reason") == Reason.CANARY_COMPLETE:
        return None
    if not (spec.get("strategy") or {}).get("canary"):
        return "spec.strategy.canary is not set, so pauseAfterCanary holds nothing"
    shown = f"Paused={cond.get('status', '?')} {cond.get('reason', '')}".rstrip()
    return (
        f"the status shows {shown}, not CanaryComplete; wait until "
        f"`weightroll status {target}` shows it"
    )


#: What ``spec.paused: true`` does, by phase, when not "units in flight finish" (``plan()``).
_PAUSE_EFFECT: dict[str, str] = {
    Phase.ROLLING_BACK: "spec.paused does not hold a rollback: it goes on",
    Phase.ROLLED_BACK: "rolled back already: nothing starts either way",
    Phase.FAILED: "halted already: nothing starts either way",
    Phase.SUCCEEDED: "pods that appear later are not updated until it is resumed",
}
#: What ``spec.paused: false`` does, by phase, when not "new units start".
_RESUME_EFFECT: dict[str, str] = {
    Phase.ROLLING_BACK: "the rollback goes on; no new unit starts after a halt",
    Phase.ROLLED_BACK: "rolled back: nothing starts until the halt is cleared",
    Phase.FAILED: "still halted: nothing starts until the halt is cleared (weightroll status)",
}


def _pause(body: Mapping[str, Any], label: str, phase: str) -> Outcome:
    if (body.get("spec") or {}).get("paused"):
        return Outcome(f"weightupdate {label} already paused (phase {phase}); nothing changed")
    effect = _PAUSE_EFFECT.get(phase, "units in flight finish, no new unit starts")
    return Outcome(f"weightupdate {label} paused (phase {phase}; {effect})", {"paused": True})


def _resume(body: Mapping[str, Any], label: str, phase: str, target: str) -> Outcome:
    spec, status = body.get("spec") or {}, body.get("status") or {}
    if not spec.get("paused"):
        cond = _paused_condition(status)
        hint = (
            f"; it holds after its canary: run `weightroll promote {target}`"
            if cond.get("status") == "True" and cond.get("reason") == Reason.CANARY_COMPLETE
            else ""
        )
        return Outcome(f"weightupdate {label} is not paused (phase {phase}){hint}; nothing changed")
    effect = _RESUME_EFFECT.get(phase, "new units start on the operator's next pass")
    strategy = spec.get("strategy") or {}
    if strategy.get("canary") and strategy.get("pauseAfterCanary"):
        effect += f"; it still holds after its canary until `weightroll promote {target}`"
    return Outcome(f"weightupdate {label} resumed (phase {phase}; {effect})", {"paused": False})


def _promote(body: Mapping[str, Any], label: str, phase: str, force: bool) -> Outcome:
    spec = body.get("spec") or {}
    if not (spec.get("strategy") or {}).get("pauseAfterCanary"):
        return Outcome(
            f"weightupdate {label} already promoted (spec.strategy.pauseAfterCanary is false; "
            f"phase {phase}); nothing changed"
        )
    missing = _canary_hold_missing(body)
    if missing is not None and not force:
        return Outcome(
            f"{label} is not holding after its canary ({missing}), or pass --force to lift the "
            "hold now",
            refused=True,
        )
    if missing is not None:
        effect = "forced: the canary, if not done, still goes first, then the rest without a hold"
    else:
        effect = "the remaining units follow, maxUnavailable at a time"
    if spec.get("paused"):
        effect += "; spec.paused still holds it until `weightroll resume`"
    return Outcome(
        f"weightupdate {label} promoted (phase {phase}; {effect})",
        {"strategy": {"pauseAfterCanary": False}},
        resource_version=(body.get("metadata") or {}).get("resourceVersion"),
    )


def _abort(body: Mapping[str, Any], label: str, phase: str, now: datetime) -> Outcome:
    status, spec = body.get("status") or {}, body.get("spec") or {}
    if status.get("abortedAt"):
        why = status.get("abortReason") or "halted"
        return Outcome(
            f"weightupdate {label} already halted ({why} at {status['abortedAt']}; phase "
            f"{phase}); nothing changed"
        )
    rollback = (spec.get("strategy") or {}).get("onFailure") == "Rollback"
    effect = (
        "the touched pods roll back (onFailure: Rollback)"
        if rollback
        else "units in flight finish, no new unit starts"
    )
    return Outcome(
        f"weightupdate {label} aborted (phase {phase}; {effect})",
        status_patch={"abortedAt": timestamp(now), "abortReason": Reason.ABORTED_BY_USER},
    )


def _retry(body: Mapping[str, Any], label: str, phase: str, now: datetime) -> Outcome:
    status = body.get("status") or {}
    failed = int((status.get("replicas") or {}).get("failed") or 0)
    halted = bool(status.get("abortedAt"))
    if not halted and not failed and phase != Phase.ROLLED_BACK:
        return Outcome(
            f"weightupdate {label} is not halted and has no failed pods (phase {phase}); "
            "nothing changed"
        )
    what = f"cleared {status.get('abortReason') or 'the halt'}" if halted else "not halted"
    return Outcome(
        f"weightupdate {label} retried ({what}; {failed} failed pods are tried again; "
        f"phase {phase})",
        status_patch={"abortedAt": None, "abortReason": None, "retriedAt": timestamp(now)},
    )


def decide(
    verb: Verb, body: Mapping[str, Any], *, force: bool = False, now: datetime | None = None
) -> Outcome:
    """What ``verb`` sends for the WeightUpdate ``body`` (as read) and the line it prints.

    Args:
        verb: the subcommand.
        body: the WeightUpdate object, status included, as the API server returned it.
        force: ``--force`` (``promote``): lift the hold even when the status does not show it.
        now: the time written by ``abort`` and ``retry``: the API server's (default: this
            machine's current time).

    Returns:
        The outcome: a patch and the line saying what changed, no patch and a line saying
        nothing changed, or a refusal with its reason and fix.
    """
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    label = f"{meta.get('namespace')}/{meta.get('name')}"
    target = f"{meta.get('name')} -n {meta.get('namespace')}"
    phase = str(status.get("phase") or Phase.PENDING)
    if verb is Verb.PAUSE:
        return _pause(body, label, phase)
    if verb is Verb.RESUME:
        return _resume(body, label, phase, target)
    if verb is Verb.ABORT:
        return _abort(body, label, phase, now or datetime.now(UTC))
    if verb is Verb.RETRY:
        return _retry(body, label, phase, now or datetime.now(UTC))
    return _promote(body, label, phase, force)


async def _steer(api: KubeApi, verb: Verb, namespace: str, name: str, *, force: bool) -> Outcome:
    try:
        body = await api.get_weightupdate(namespace, name)
        # abort/retry stamp the API server's time, not this machine's: the operator compares
        # retriedAt with the start of attempts it stamped itself (a CLI clock minutes behind
        # would leave the failed pods failed; minutes ahead, retry later attempts too)
        outcome = decide(verb, body, force=force, now=api.server_date)
        if outcome.patch is not None:
            await api.patch_weightupdate_spec(
                namespace, name, outcome.patch, resource_version=outcome.resource_version
            )
        if outcome.status_patch is not None:
            await api.patch_weightupdate_status(namespace, name, outcome.status_patch)
        return outcome
    finally:
        await api.close()


def _parser(verb: str) -> argparse.ArgumentParser:
    """The parser of ``weightroll VERB``: the target, plus ``--force`` where it applies."""
    v = Verb(verb)
    p = argparse.ArgumentParser(prog=f"weightroll {v}", description=_DESCRIPTION[v], epilog=_EPILOG)
    add_target_arguments(p)
    if v in _FORCE_HELP:
        p.add_argument("--force", action="store_true", help=_FORCE_HELP[v])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``VERB NAME [options]`` (``weightroll`` passes the subcommand as the first argument).

    Args:
        argv: the verb, then its arguments.

    Returns:
        The exit status (see the epilog): 0 done, 1 refused or an API error, 2 bad usage.
    """
    args_in = list(argv or [])
    if not args_in or args_in[0] not in VERBS:
        print(f"weightroll: choose one of {', '.join(VERBS)}", file=sys.stderr)
        return 2
    verb = Verb(args_in[0])
    prog = f"weightroll {verb}"
    args = _parser(verb).parse_args(args_in[1:])
    config = load_config(prog, args.kubeconfig, args.context)
    if config is None:
        return 2
    ns, name = target_namespace(args), args.name
    try:
        outcome = asyncio.run(
            _steer(
                KubeApi(config),
                verb,
                ns,
                name,
                force=getattr(args, "force", False),
            )
        )
    except KubeConflict:
        print(
            f"{prog}: {ns}/{name} changed between the check and the patch; run it again",
            file=sys.stderr,
        )
        return 1
    except KubeError as e:
        forbidden = (
            f"; your user may not get or patch weightupdates.weightroll.io in namespace {ns} "
            f"(check: kubectl auth can-i patch weightupdates.weightroll.io -n {ns})"
        )
        print(
            f"{prog}: {kube_error_line(e, config.server, ns, name, forbidden=forbidden)}",
            file=sys.stderr,
        )
        return 1
    if outcome.refused:
        print(f"{prog}: {outcome.line}", file=sys.stderr)
        return 1
    print(outcome.line)
    return 0
