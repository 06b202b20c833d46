"""``weightroll pause|resume|promote``: argument parsing and the pure decision (which merge patch,
which line) for each verb, table-driven with exact goldens. The same verbs against kmock (the
patch on the wire, not-found, idempotence): ``tests/contract/rollout/test_control.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from weightroll_operator.control import VERBS, Outcome, Verb, _parser, decide, main

RECENT = "2026-01-01T11:55:00Z"
LONG_AGO = "2026-01-01T10:00:00Z"  # hours before RECENT: longer than the default deadline
WU = "weightupdate ml/llama-v2"


def wu(
    *,
    phase: str = "Progressing",
    paused: bool = False,
    canary: int | None = None,
    hold: bool = False,
    reason: str = "NotPaused",
    generation: int = 3,
    observed: int = 3,
    last: str = RECENT,
    aborted: bool = False,
) -> dict[str, Any]:
    """A WeightUpdate as read from the API server; ``reason``: the Paused condition's reason."""
    strategy: dict[str, Any] = {"maxUnavailable": 2}
    if canary is not None:
        strategy["canary"] = canary
    if hold:
        strategy["pauseAfterCanary"] = True
    status: dict[str, Any] = {
        "phase": phase,
        "observedGeneration": observed,
        "targetVersion": "v2",
        "lastProgressTime": last,
        "conditions": [
            {"type": "Progressing", "status": "True", "reason": "RolloutProgressing"},
            {"type": "Paused", "status": str(reason != "NotPaused"), "reason": reason},
        ],
    }
    if aborted:
        status |= {"abortedAt": last, "abortReason": "FailureBudgetExceeded"}
    return {
        "metadata": {
            "name": "llama-v2",
            "namespace": "ml",
            "generation": generation,
            "resourceVersion": "42",
        },
        "spec": {"version": "v2", "paused": paused, "strategy": strategy},
        "status": status,
    }


CANARY_DONE = {"phase": "Paused", "canary": 1, "hold": True, "reason": "CanaryComplete"}
PAUSE: dict[str, Any] = {"paused": True}
RESUME: dict[str, Any] = {"paused": False}
PROMOTE: dict[str, Any] = {"strategy": {"pauseAfterCanary": False}}
# (verb, wu() overrides, --force) -> (patch, refused, line)
CASES: dict[str, tuple[Verb, dict[str, Any], bool, Outcome]] = {
    "pause": (
        Verb.PAUSE,
        {},
        False,
        Outcome(
            f"{WU} paused (phase Progressing; units in flight finish, no new unit starts)", PAUSE
        ),
    ),
    "pause-idempotent": (
        Verb.PAUSE,
        {"phase": "Paused", "paused": True, "reason": "PausedBySpec"},
        False,
        Outcome(f"{WU} already paused (phase Paused); nothing changed"),
    ),
    "pause-rolling-back": (
        Verb.PAUSE,
        {"phase": "RollingBack", "aborted": True},
        False,
        Outcome(
            f"{WU} paused (phase RollingBack; spec.paused does not hold a rollback: it goes on)",
            PAUSE,
        ),
    ),
    "pause-succeeded": (
        Verb.PAUSE,
        {"phase": "Succeeded"},
        False,
        Outcome(
            f"{WU} paused (phase Succeeded; pods that appear later are not updated until it is "
            "resumed)",
            PAUSE,
        ),
    ),
    "resume": (
        Verb.RESUME,
        {"phase": "Paused", "paused": True, "reason": "PausedBySpec"},
        False,
        Outcome(
            f"{WU} resumed (phase Paused; new units start on the operator's next pass)", RESUME
        ),
    ),
    "resume-idempotent": (
        Verb.RESUME,
        {},
        False,
        Outcome(f"{WU} is not paused (phase Progressing); nothing changed"),
    ),
    "resume-idempotent-canary-hold": (
        Verb.RESUME,
        CANARY_DONE,
        False,
        Outcome(
            f"{WU} is not paused (phase Paused); it holds after its canary: run "
            "`weightroll promote llama-v2 -n ml`; nothing changed"
        ),
    ),
    "resume-canary-hold-stays": (
        Verb.RESUME,
        {**CANARY_DONE, "paused": True, "reason": "PausedBySpec"},
        False,
        Outcome(
            f"{WU} resumed (phase Paused; new units start on the operator's next pass; it still "
            "holds after its canary until `weightroll promote llama-v2 -n ml`)",
            RESUME,
        ),
    ),
    "resume-failed": (
        Verb.RESUME,
        {"phase": "Failed", "paused": True, "aborted": True, "last": LONG_AGO},
        False,
        Outcome(
            f"{WU} resumed (phase Failed; still halted: nothing starts until the halt is cleared "
            "(weightroll status))",
            RESUME,
        ),
    ),
    "resume-after-a-long-hold": (  # time on hold does not count against the deadline
        Verb.RESUME,
        {"phase": "Paused", "paused": True, "reason": "PausedBySpec", "last": LONG_AGO},
        False,
        Outcome(
            f"{WU} resumed (phase Paused; new units start on the operator's next pass)", RESUME
        ),
    ),
    "promote": (
        Verb.PROMOTE,
        CANARY_DONE,
        False,
        Outcome(
            f"{WU} promoted (phase Paused; the remaining units follow, maxUnavailable at a time)",
            PROMOTE,
            resource_version="42",
        ),
    ),
    "promote-idempotent": (
        Verb.PROMOTE,
        {"canary": 1},
        False,
        Outcome(
            f"{WU} already promoted (spec.strategy.pauseAfterCanary is false; phase Progressing); "
            "nothing changed"
        ),
    ),
    "promote-canary-running-refused": (
        Verb.PROMOTE,
        {"canary": 1, "hold": True},
        False,
        Outcome(
            "ml/llama-v2 is not holding after its canary (the status shows Paused=False "
            "NotPaused, not CanaryComplete; wait until `weightroll status llama-v2 -n ml` shows "
            "it), or pass --force to lift the hold now",
            refused=True,
        ),
    ),
    "promote-canary-running-forced": (
        Verb.PROMOTE,
        {"canary": 1, "hold": True},
        True,
        Outcome(
            f"{WU} promoted (phase Progressing; forced: the canary, if not done, still goes "
            "first, then the rest without a hold)",
            PROMOTE,
            resource_version="42",
        ),
    ),
    "promote-paused-by-spec-refused": (
        Verb.PROMOTE,
        {**CANARY_DONE, "paused": True, "reason": "PausedBySpec"},
        False,
        Outcome(
            "ml/llama-v2 is not holding after its canary (spec.paused hides the canary hold; run "
            "`weightroll resume llama-v2 -n ml` first), or pass --force to lift the hold now",
            refused=True,
        ),
    ),
    "promote-paused-by-spec-forced": (
        Verb.PROMOTE,
        {**CANARY_DONE, "paused": True, "reason": "PausedBySpec"},
        True,
        Outcome(
            f"{WU} promoted (phase Paused; forced: the canary, if not done, still goes first, "
            "then the rest without a hold; spec.paused still holds it until `weightroll resume`)",
            PROMOTE,
            resource_version="42",
        ),
    ),
    "promote-stale-status-refused": (
        Verb.PROMOTE,
        {**CANARY_DONE, "generation": 4},
        False,
        Outcome(
            "ml/llama-v2 is not holding after its canary (the operator has not reported on "
            "generation 4 yet (status is about 3); retry in a few seconds), or pass --force to "
            "lift the hold now",
            refused=True,
        ),
    ),
    "promote-without-canary-refused": (
        Verb.PROMOTE,
        {"hold": True},
        False,
        Outcome(
            "ml/llama-v2 is not holding after its canary (spec.strategy.canary is not set, so "
            "pauseAfterCanary holds nothing), or pass --force to lift the hold now",
            refused=True,
        ),
    ),
    "promote-after-a-long-hold": (
        Verb.PROMOTE,
        {**CANARY_DONE, "last": LONG_AGO},
        False,
        Outcome(
            f"{WU} promoted (phase Paused; the remaining units follow, maxUnavailable at a time)",
            PROMOTE,
            resource_version="42",
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decide(case: str) -> None:
    verb, overrides, force, expected = CASES[case]
    assert decide(verb, wu(**overrides), force=force) == expected


def test_a_refusal_carries_no_patch() -> None:
    with pytest.raises(ValueError, match="no patch"):
        Outcome("x", {"paused": True}, refused=True)


# ---- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("verb", "argv", "expected"),
    [
        (
            "pause",
            ["llama-v2"],
            # no -n: None, resolved from the kubeconfig context (status_view.target_namespace)
            {"name": "llama-v2", "namespace": None, "kubeconfig": None, "context": None},
        ),
        (
            "resume",
            ["llama-v2", "-n", "ml", "--kubeconfig", "/k", "--context", "c"],
            {
                "name": "llama-v2",
                "namespace": "ml",
                "kubeconfig": "/k",
                "context": "c",
            },
        ),
        (
            "promote",
            ["llama-v2", "--namespace=ml", "--force"],
            {
                "name": "llama-v2",
                "namespace": "ml",
                "kubeconfig": None,
                "context": None,
                "force": True,
            },
        ),
    ],
)
def test_parse(verb: str, argv: list[str], expected: dict[str, Any]) -> None:
    assert vars(_parser(verb).parse_args(argv)) == expected


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["pause", "llama-v2", "--force"], "unrecognized arguments: --force"),
        (["resume", "llama-v2", "--force"], "unrecognized arguments: --force"),
        (["promote"], "the following arguments are required: NAME"),
    ],
)
def test_usage_errors(argv: list[str], error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(error)


@pytest.mark.parametrize("argv", [[], ["stop", "llama-v2"]])
def test_main_needs_a_verb(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert (
        capsys.readouterr().err
        == "weightroll: choose one of pause, resume, promote, abort, retry\n"
    )


@pytest.mark.parametrize("verb", VERBS)
def test_missing_kubeconfig_is_one_line(
    verb: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([verb, "llama-v2", "--kubeconfig", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == f"weightroll {verb}: stat {tmp_path / 'absent'}: no such file or directory\n"
