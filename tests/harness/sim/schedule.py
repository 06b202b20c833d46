"""A schedule as data: the steps a state machine ran, recorded so a failing one can be replayed
and shrunk (``make soak``; docs/architecture.md, "The simulation tier").

Hypothesis shrinks a failing stateful run itself, but it also works on every argument of every
step, and its results still carried steps the violation did not need (the replays in
``tests/sim`` were shrunk further by hand). :func:`shrink` is greedy step deletion
(delta debugging without the complement step): drop chunks of steps, halving the chunk size
down to one step, keep every deletion after which the schedule still fails the same way, and
start over until a whole round deletes nothing. What remains is 1-minimal: deleting any single
step makes the violation go away. :func:`render` prints it as the body of a replay test.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

__all__ = ["Step", "recorded", "render", "shrink"]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Step:
    """One rule call of a schedule: the rule's name and its arguments."""

    rule: str
    args: tuple[tuple[str, Any], ...]

    def __str__(self) -> str:
        return f"sim.{self.rule}({', '.join(f'{k}={v!r}' for k, v in self.args)})"


def recorded(rule: Callable[P, R]) -> Callable[P, R]:
    """Record each call of a state machine's rule (put it under ``@rule``/``@initialize``) in
    the machine's ``schedule``, before the rule runs: a step that fails is part of it. Every
    argument is recorded by name (Hypothesis passes them so; a hand-written replay may not)."""
    signature = inspect.signature(rule)

    @functools.wraps(rule)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(*args, **kwargs)
        machine, *_ = bound.arguments.values()
        assert hasattr(machine, "schedule"), "a recorded rule's machine keeps a `schedule` list"
        named = sorted((k, v) for k, v in list(bound.arguments.items())[1:])
        machine.schedule.append(Step(rule.__name__, tuple(named)))
        return rule(*args, **kwargs)

    return wrapper


def shrink(
    steps: Sequence[Step],
    fails: Callable[[Sequence[Step]], bool],
    *,
    keep_first: int = 1,
    budget: int = 2000,
) -> list[Step]:
    """The 1-minimal sub-schedule of ``steps`` that still ``fails`` (greedy deletion, module
    doc). The first ``keep_first`` steps (the machine's ``@initialize``) are never deleted;
    ``budget`` bounds the replays (the result is then smaller, not 1-minimal)."""
    head, rest = list(steps[:keep_first]), list(steps[keep_first:])
    tries = 0
    changed = True
    while changed and tries < budget:
        changed = False
        chunk = max(1, len(rest) // 2)
        while chunk >= 1 and tries < budget:
            start = 0
            while start < len(rest) and tries < budget:
                candidate = rest[:start] + rest[start + chunk :]
                tries += 1
                if fails(head + candidate):
                    rest, changed = candidate, True
                else:
                    start += chunk
            chunk //= 2
    return head + rest


def render(steps: Sequence[Step], header: str) -> str:
    """``steps`` as the body of a replay test (``with replay(...) as sim:``), after a comment
    line ``header`` (what failed)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{step}" for step in steps]
    return "\n".join(lines)
