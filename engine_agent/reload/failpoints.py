"""Failpoints: deterministic fault injection for tests of the fail-closed paths.

Set ``WEIGHTROLL_FAILPOINTS`` in the engine's environment to a comma-separated list of
``<point>[@<rank>][=<action>]`` entries, e.g. ``load@tp1`` (the load call fails on TP rank 1
only) or ``finish@tp0=hang:30`` (finish hangs for 30 s on TP rank 0). ``<point>`` is a call
(begin, load, finish, abort, state; checked on entry) or a step boundary inside one
(:data:`POINTS`); ``<rank>`` is ``tp<N>``, ``pp<N>`` or ``dp<N>``; the action is ``error``
(default) or ``hang:<seconds>``. A step point fires at its first occurrence in a call (for
``copy.after``: after the first module was copied into live storage, before any other).
Unset (the production default), nothing happens.

``WEIGHTROLL_FAILPOINTS_FILE`` names a file holding the same list, re-read on every call, so a
test can arm and disarm failpoints in a running multi-process engine.

Faults that only one rank of a real engine suffers (a rank that cannot read its part, a rank
that hangs) cannot be provoked from outside the process; this is the same technique as etcd's
gofail, scoped to one environment variable that production deployments never set.
"""

from __future__ import annotations

import os
import time

from engine_agent.errors import SourceUnavailable
from engine_agent.protocol import RankId

__all__ = ["POINTS", "check"]

#: Every failpoint, in the order an update passes them (full and partial updates skip the
#: ``sparse.*`` points, sparse updates skip ``load.staged`` to ``copy.after``; ``tied.*`` fire
#: only on models with tied parameters).
POINTS = (
    "begin",
    "begin.snapshot",
    "load",
    "load.dry_run",
    "load.staged",
    "post_load.before",
    "post_load.after",
    "refresh.after",
    "copy.before",
    "copy.after",
    "tied.before",
    "tied.after",
    "sparse.before_write",
    "sparse.after_write",
    "finish",
    "finish.coverage",
    "finish.identity",
)

ENV = "WEIGHTROLL_FAILPOINTS"
FILE_ENV = "WEIGHTROLL_FAILPOINTS_FILE"


def check(call: str, rank: RankId) -> None:
    """Fire the failpoint for ``call`` on ``rank`` if one is configured."""
    spec = os.environ.get(ENV, "")
    path = os.environ.get(FILE_ENV)
    if path and os.path.exists(path):
        with open(path) as handle:
            spec = f"{spec},{handle.read().strip()}"
    for item in filter(None, (part.strip() for part in spec.split(","))):
        target, _, action = item.partition("=")
        name, _, where = target.partition("@")
        if name != call or (where and not _matches(where, rank)):
            continue
        if action.startswith("hang:"):
            time.sleep(float(action.removeprefix("hang:")))
            continue
        raise SourceUnavailable(
            f"failpoint {item!r}: injected failure of {call} on rank {rank.key}", field="path"
        )


def _matches(where: str, rank: RankId) -> bool:
    kind, number = where[:2], where[2:]
    value = {"tp": rank.tp, "pp": rank.pp, "dp": rank.dp}.get(kind)
    return value is not None and number.isdigit() and int(number) == value
