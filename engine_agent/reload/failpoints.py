"""Failpoints: deterministic fault injection for tests of the fail-closed paths.

Set ``WEIGHTROLL_FAILPOINTS`` in the engine's environment to a comma-separated list of
``<point>[@<rank>][=<action>]`` entries, e.g. ``load@tp1`` (the load call fails on TP rank 1
only) or ``finish@tp0=hang:30`` (finish hangs for 30 s on TP rank 0). ``<point>`` is a call
(begin, load, finish, abort, state; checked on entry) or a step boundary inside one
(:data:`POINTS`); ``<rank>`` is ``tp<N>``, ``pp<N>`` or ``dp<N>``; the action is ``error``
(default), ``hang:<seconds>``, ``signal:<file>`` (create ``<file>`` and go on) or
``wait:<file>`` (block until ``<file>`` exists, at most :data:`WAIT_LIMIT_SECONDS`, then fail).
A step point fires at its first occurrence in a call (for ``copy.after``: after the first
module was copied into live storage, before any other). Unset (the production default),
nothing happens.

``signal`` and ``wait`` order the ranks of one engine against the test without timing: e.g.
``load.read@tp0=signal:/t/read,load@tp1=wait:/t/go`` lets the test change the source after TP
rank 0 read it and before TP rank 1 starts (``tests/server/test_source_swap_tp2.py``).

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
#: only on models with tied parameters; ``load.read`` fires once this rank's loaders consumed
#: and hashed every tensor of the batch; only prefetched updates pass ``prefetch`` to
#: ``prefetched`` — ``prefetch.read`` fires on the reading thread, before its first byte, and
#: ``prefetch.post_load`` before each module's post-load step on its shadow, inside the
#: ``prefetched`` call that finds the read done, ``prefetch.seal_digest`` on the seal's digest
#: thread, before each processed shadow's digests — and ``apply``, which replaces ``load``).
POINTS = (
    "prefetch",
    "prefetch.read",
    "prefetched",
    "prefetch.post_load",
    "prefetch.seal_digest",
    "begin",
    "begin.snapshot",
    "load",
    "apply",
    "load.dry_run",
    "load.staged",
    "post_load.before",
    "post_load.after",
    "refresh.after",
    "copy.before",
    "copy.after",
    "tied.before",
    "tied.after",
    "load.read",
    "sparse.before_write",
    "sparse.after_write",
    "finish",
    "finish.coverage",
    "finish.identity",
)

ENV = "WEIGHTROLL_FAILPOINTS"
FILE_ENV = "WEIGHTROLL_FAILPOINTS_FILE"
#: How long a ``wait:`` failpoint blocks before it fails the call: a test that never releases
#: the rank must not hang the engine for longer than the agent's own bounds.
WAIT_LIMIT_SECONDS = 120.0
#: How often a ``wait:`` failpoint looks for its file.
_WAIT_POLL_SECONDS = 0.05


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
        if action.startswith("signal:"):
            with open(action.removeprefix("signal:"), "a"):
                pass
            continue
        if action.startswith("wait:") and _wait_for(action.removeprefix("wait:")):
            continue
        raise SourceUnavailable(
            f"failpoint {item!r}: injected failure of {call} on rank {rank.key}", field="path"
        )


def _matches(where: str, rank: RankId) -> bool:
    kind, number = where[:2], where[2:]
    value = {"tp": rank.tp, "pp": rank.pp, "dp": rank.dp}.get(kind)
    return value is not None and number.isdigit() and int(number) == value


def _wait_for(path: str) -> bool:
    """Block until ``path`` exists; ``False`` after :data:`WAIT_LIMIT_SECONDS` without it."""
    deadline = time.monotonic() + WAIT_LIMIT_SECONDS
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_WAIT_POLL_SECONDS)
    return True
