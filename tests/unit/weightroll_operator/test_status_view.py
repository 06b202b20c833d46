"""``weightroll status``: golden texts for a running, a failed and a succeeded update, and the
command against kmock (the same objects served by an emulated API server) with its errors.

The fixture objects are what the operator writes (``WeightUpdateStatus`` validates each), so a
change of the status model that the view does not follow fails here too.
"""

# The golden texts are terminal output, wider than the code.
# ruff: noqa: E501

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.status_view import main, render

from tests.harness.kube_fleet import fleet_emulator, write_kubeconfig

NS = "ml"


def _wu(name: str, version: str, status: dict[str, Any]) -> dict[str, Any]:
    api.WeightUpdateStatus.model_validate(status)  # the fixture is a status the operator writes
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "llama"}},
            "version": version,
            "source": {"uri": f"file:///models/llama/{version}"},
        },
        "status": status,
    }


def _cond(ctype: str, status: str, reason: str, message: str = "") -> dict[str, Any]:
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": "2026-11-30T10:00:00Z",
    }


def _event(at: str, etype: str, reason: str, message: str) -> dict[str, Any]:
    return {"lastTimestamp": at, "type": etype, "reason": reason, "message": message}


RUNNING = _wu(
    "llama-v2",
    "v2",
    {
        "phase": "Progressing",
        "observedGeneration": 1,
        "targetVersion": "v2",
        "replicas": {"total": 4, "updated": 1, "verified": 1, "draining": 1},
        "stableVersion": "v1",
        "conditions": [
            _cond("Progressing", "True", "RolloutProgressing", "1 units in flight"),
            _cond("Verified", "False", "ReplicasUnverified", "1/4 pods verified at v2"),
            _cond("Degraded", "False", "NoFailures"),
            _cond("Paused", "False", "NotPaused"),
            _cond("Blocked", "False", "NotBlocked"),
        ],
        "pods": [
            {"name": "llama-1", "state": "Updating", "version": "v2"},
            {"name": "llama-2", "state": "Pending"},
            {"name": "llama-3", "state": "Pending"},
            {"name": "llama-0", "state": "Verified", "version": "v2"},
        ],
        "startTime": "2026-11-30T10:00:00Z",
        "lastProgressTime": "2026-11-30T10:01:30Z",
        "message": "Progressing: 1/4 pods verified at v2; 1 updating",
    },
)
RUNNING_EVENTS = [
    _event("2026-11-30T10:01:30Z", "Normal", "UnitDraining", "Draining llama-1 for weights v2"),
    _event(
        "2026-11-30T10:00:00Z", "Normal", "PhaseChanged", "Phase changed from None to Progressing"
    ),
    _event("2026-11-30T10:00:00Z", "Normal", "UnitDraining", "Draining llama-0 for weights v2"),
    _event(
        "2026-11-30T10:01:30Z",
        "Normal",
        "UnitVerified",
        "Verified llama-0 at v2 and restored traffic",
    ),
]
RUNNING_TEXT = """\
Name:      ml/llama-v2
Version:   v2  (stable: v1)
Phase:     Progressing
Message:   Progressing: 1/4 pods verified at v2; 1 updating
Replicas:  total 4, updated 1, verified 1, draining 1, failed 0, stale 0

Conditions:
  TYPE         STATUS  REASON              MESSAGE
  Progressing  True    RolloutProgressing  1 units in flight
  Verified     False   ReplicasUnverified  1/4 pods verified at v2
  Degraded     False   NoFailures
  Paused       False   NotPaused
  Blocked      False   NotBlocked

Pods:
  POD      STATE     VERSION  REASON
  llama-1  Updating  v2
  llama-2  Pending   -
  llama-3  Pending   -
  llama-0  Verified  v2

Events:
  TIME                  TYPE    REASON        MESSAGE
  2026-11-30T10:00:00Z  Normal  PhaseChanged  Phase changed from None to Progressing
  2026-11-30T10:00:00Z  Normal  UnitDraining  Draining llama-0 for weights v2
  2026-11-30T10:01:30Z  Normal  UnitDraining  Draining llama-1 for weights v2
  2026-11-30T10:01:30Z  Normal  UnitVerified  Verified llama-0 at v2 and restored traffic"""

FAILED = _wu(
    "llama-v3",
    "v3",
    {
        "phase": "Failed",
        "observedGeneration": 2,
        "targetVersion": "v3",
        "replicas": {"total": 3, "updated": 1, "verified": 1, "failed": 1, "stale": 1},
        "stableVersion": "v2",
        "conditions": [
            _cond(
                "Progressing", "False", "FailureBudgetExceeded", "Halted at 2026-11-30T11:02:00Z"
            ),
            _cond("Verified", "False", "ReplicasUnverified", "1/3 pods verified at v3"),
            _cond(
                "Degraded",
                "True",
                "UnitsFailed",
                "llama-1: UpdateFailed: manifest_mismatch: up_proj",
            ),
            _cond("Paused", "False", "NotPaused"),
            _cond("Blocked", "False", "NotBlocked"),
        ],
        "pods": [
            {
                "name": "llama-1",
                "state": "Failed",
                "version": "v3",
                "reason": "UpdateFailed: manifest_mismatch: up_proj",
            },
            {"name": "llama-2", "state": "Pending"},
            {"name": "llama-0", "state": "Verified", "version": "v3"},
        ],
        "startTime": "2026-11-30T11:00:00Z",
        "lastProgressTime": "2026-11-30T11:02:00Z",
        "abortedAt": "2026-11-30T11:02:00Z",
        "abortReason": "FailureBudgetExceeded",
        "message": (
            "Failed: 1/3 pods verified at v3; 1 failed; 1 stale; halted: FailureBudgetExceeded"
        ),
    },
)
FAILED_EVENTS = [
    _event(
        "2026-11-30T11:02:00Z",
        "Warning",
        "UnitFailed",
        "Failed update of llama-1: manifest_mismatch",
    ),
    _event(
        "2026-11-30T11:02:00Z",
        "Warning",
        "FailureBudgetExceeded",
        "Halted: 1 failed units exceed maxFailedReplicas 0",
    ),
    _event(
        "2026-11-30T11:02:00Z",
        "Warning",
        "PhaseChanged",
        "Phase changed from Progressing to Failed",
    ),
]
FAILED_TEXT = """\
Name:      ml/llama-v3
Version:   v3  (stable: v2)
Phase:     Failed
Message:   Failed: 1/3 pods verified at v3; 1 failed; 1 stale; halted: FailureBudgetExceeded
Replicas:  total 3, updated 1, verified 1, draining 0, failed 1, stale 1

Conditions:
  TYPE         STATUS  REASON                 MESSAGE
  Progressing  False   FailureBudgetExceeded  Halted at 2026-11-30T11:02:00Z
  Verified     False   ReplicasUnverified     1/3 pods verified at v3
  Degraded     True    UnitsFailed            llama-1: UpdateFailed: manifest_mismatch: up_proj
  Paused       False   NotPaused
  Blocked      False   NotBlocked

Pods:
  POD      STATE     VERSION  REASON
  llama-1  Failed    v3       UpdateFailed: manifest_mismatch: up_proj
  llama-2  Pending   -
  llama-0  Verified  v3

Events:
  TIME                  TYPE     REASON                 MESSAGE
  2026-11-30T11:02:00Z  Warning  UnitFailed             Failed update of llama-1: manifest_mismatch
  2026-11-30T11:02:00Z  Warning  FailureBudgetExceeded  Halted: 1 failed units exceed maxFailedReplicas 0
  2026-11-30T11:02:00Z  Warning  PhaseChanged           Phase changed from Progressing to Failed"""

SUCCEEDED = _wu(
    "llama-v2",
    "v2",
    {
        "phase": "Succeeded",
        "observedGeneration": 1,
        "targetVersion": "v2",
        "replicas": {"total": 2, "updated": 2, "verified": 2},
        "stableVersion": "v2",
        "conditions": [
            _cond("Progressing", "True", "RolloutComplete", "All selected pods serve v2"),
            _cond("Verified", "True", "AllReplicasVerified", "2/2 pods verified at v2"),
            _cond("Degraded", "False", "NoFailures"),
            _cond("Paused", "False", "NotPaused"),
            _cond("Blocked", "False", "NotBlocked"),
        ],
        "pods": [
            {"name": "llama-0", "state": "Verified", "version": "v2"},
            {"name": "llama-1", "state": "Verified", "version": "v2"},
        ],
        "startTime": "2026-11-30T10:00:00Z",
        "completionTime": "2026-11-30T10:03:00Z",
        "lastProgressTime": "2026-11-30T10:03:00Z",
        "message": "Succeeded: 2/2 pods verified at v2",
    },
)
SUCCEEDED_EVENTS = [
    _event(
        "2026-11-30T10:03:00Z",
        "Normal",
        "UnitVerified",
        "Verified llama-1 at v2 and restored traffic",
    ),
    _event(
        "2026-11-30T10:03:00Z",
        "Normal",
        "PhaseChanged",
        "Phase changed from Progressing to Succeeded",
    ),
]
SUCCEEDED_TEXT = """\
Name:      ml/llama-v2
Version:   v2  (stable: v2)
Phase:     Succeeded
Message:   Succeeded: 2/2 pods verified at v2
Replicas:  total 2, updated 2, verified 2, draining 0, failed 0, stale 0

Conditions:
  TYPE         STATUS  REASON               MESSAGE
  Progressing  True    RolloutComplete      All selected pods serve v2
  Verified     True    AllReplicasVerified  2/2 pods verified at v2
  Degraded     False   NoFailures
  Paused       False   NotPaused
  Blocked      False   NotBlocked

Pods:
  POD      STATE     VERSION  REASON
  llama-0  Verified  v2
  llama-1  Verified  v2

Events:
  TIME                  TYPE    REASON        MESSAGE
  2026-11-30T10:03:00Z  Normal  UnitVerified  Verified llama-1 at v2 and restored traffic
  2026-11-30T10:03:00Z  Normal  PhaseChanged  Phase changed from Progressing to Succeeded"""

CASES = {
    "running": (RUNNING, RUNNING_EVENTS, RUNNING_TEXT),
    "failed": (FAILED, FAILED_EVENTS, FAILED_TEXT),
    "succeeded": (SUCCEEDED, SUCCEEDED_EVENTS, SUCCEEDED_TEXT),
}
#: Exit status of ``weightroll status`` per case: 0 Succeeded, 3 Failed, 4 not finished.
EXIT = {"running": 4, "failed": 3, "succeeded": 0}


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_golden(case: str) -> None:
    body, events, expected = CASES[case]
    assert render(body, events) == expected


def test_render_before_the_operator_wrote_a_status() -> None:
    body = {k: v for k, v in copy.deepcopy(RUNNING).items() if k != "status"}
    text = render(body, [])
    assert "Phase:     Pending" in text
    assert "no status yet: is the weightroll operator running?" in text
    assert text.endswith("Events:\n  (none)")


def test_render_keeps_only_the_last_events() -> None:
    text = render(RUNNING, RUNNING_EVENTS, last=1)
    assert "UnitVerified" in text and "PhaseChanged" not in text


# ---- the command against kmock ------------------------------------------------------------


async def _create(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> None:
    async with http.post(path, json=body) as resp:
        assert resp.status < 400, await resp.text()


@pytest.mark.asyncio
@pytest.mark.parametrize("case", sorted(CASES))
async def test_command_against_kmock(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    body, events, expected = CASES[case]
    name = body["metadata"]["name"]
    async with fleet_emulator() as (_, url), aiohttp.ClientSession(base_url=url) as http:
        await _create(http, f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}", body)
        other = {"involvedObject": {"name": "someone-else"}, "reason": "Noise", "message": "x"}
        for i, event in enumerate([*events, other]):
            involved = event.get("involvedObject") or {
                "apiVersion": api.API_VERSION,
                "kind": api.KIND,
                "namespace": NS,
                "name": name,
            }
            obj = {**event, "involvedObject": involved, "metadata": {"name": f"e{i}"}}
            await _create(http, f"/api/v1/namespaces/{NS}/events", obj)
        config = write_kubeconfig(tmp_path, url)
        argv = [name, "-n", NS, "--kubeconfig", str(config)]
        rc = await asyncio.to_thread(main, argv)
        out = capsys.readouterr()
        assert (rc, out.err) == (EXIT[case], "")
        assert out.out == expected + "\n"

        rc = await asyncio.to_thread(main, ["nope", "-n", NS, "--kubeconfig", str(config)])
        err = capsys.readouterr().err
        assert rc == 1
        assert err == (
            f"weightroll status: WeightUpdate {NS}/nope not found; list them with "
            f"`kubectl get weightupdates -n {NS}` (or -A), or pass -n NAMESPACE\n"
        )


def test_missing_kubeconfig_is_one_line_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["llama-v2", "--kubeconfig", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == f"weightroll status: stat {tmp_path / 'absent'}: no such file or directory\n"


def test_unreachable_api_server_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_kubeconfig(tmp_path, "http://127.0.0.1:9")  # discard port: connection refused
    assert main(["llama-v2", "--kubeconfig", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err == (
        "weightroll status: The connection to the server 127.0.0.1:9 was refused - did you "
        "specify the right host or port?\n"
    )


def _pods_section(body: dict[str, Any]) -> str:
    """The ``Pods:`` table of ``weightroll status`` for ``body``."""
    return render(body, []).split("Pods:\n")[1].split("\n\n")[0]


def test_render_grouped_pods_shows_the_unit() -> None:
    body = copy.deepcopy(RUNNING)
    body["status"]["pods"] = [
        {"name": "ds-0", "state": "Updating", "version": "v2", "unit": "0"},
        {"name": "ds-0-1", "state": "Updating", "version": "v2", "unit": "0"},
        {"name": "ds-1", "state": "Pending", "unit": "1"},
    ]
    pods = _pods_section(body)
    assert pods == (
        "  POD     UNIT  STATE     VERSION  REASON\n"
        "  ds-0    0     Updating  v2\n"
        "  ds-0-1  0     Updating  v2\n"
        "  ds-1    1     Pending   -"
    )


def test_render_shows_each_pod_s_step_while_pods_are_worked_on() -> None:
    body = copy.deepcopy(RUNNING)
    body["status"]["pods"] = [
        {"name": "p0", "state": "Updating", "version": "v2", "step": "Swapping"},
        {"name": "p1", "state": "Prefetching", "version": "v2", "step": "Prefetched"},
        {"name": "p2", "state": "Verified", "version": "v2", "step": "Ready"},
        {"name": "p3", "state": "Pending"},
    ]
    pods = _pods_section(body)
    assert pods == (
        "  POD  STATE        STEP        VERSION  REASON\n"
        "  p0   Updating     Swapping    v2\n"
        "  p1   Prefetching  Prefetched  v2\n"
        "  p2   Verified     Ready       v2\n"
        "  p3   Pending      -           -"
    )
    # every pod Ready: the column would only repeat STATE
    for entry in body["status"]["pods"]:
        entry["step"] = "Ready" if entry["state"] == "Verified" else None
    assert "STEP" not in render(body, [])
