"""``weightroll pause|resume|promote`` against kmock: the exact merge patch each verb sends (method,
path, content type, body), what the stored object looks like afterwards, the promote refusal,
not-found with its fix, and idempotence (a verb whose intent holds sends no write at all).

The decision table itself (every phase, every refusal) is in
``tests/unit/weightroll_operator/test_control.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import pytest
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.control import main

from tests.harness.kube_fleet import (
    FleetEmulator,
    fleet_emulator,
    make_weightupdate,
    write_kubeconfig,
)

NS = "ml"
NAME = "llama-v3"
WU_PATH = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}"


def _held_after_canary() -> dict[str, Any]:
    """A WeightUpdate whose canary is verified and which holds (what the operator reports)."""
    body = make_weightupdate(
        NAME, "v3", namespace=NS, strategy={"canary": 1, "pauseAfterCanary": True}
    )
    body["status"] = {
        "phase": "Paused",
        "observedGeneration": 1,
        "targetVersion": "v3",
        "conditions": [
            {"type": "Paused", "status": "True", "reason": "CanaryComplete"},
        ],
    }
    return body


_WU = f"weightupdate {NS}/{NAME}"
_TARGET = f"{NAME} -n {NS}"
#: One WeightUpdate held after its canary, steered in turn: (verb, (exit, stdout, stderr)).
STEPS: list[tuple[str, tuple[int, str, str]]] = [
    (
        "pause",
        (0, f"{_WU} paused (phase Paused; units in flight finish, no new unit starts)\n", ""),
    ),
    ("pause", (0, f"{_WU} already paused (phase Paused); nothing changed\n", "")),
    # spec.paused hides the canary hold: promote refuses and says to resume first
    (
        "promote",
        (
            1,
            "",
            f"weightroll promote: {NS}/{NAME} is not holding after its canary (spec.paused hides "
            f"the canary hold; run `weightroll resume {_TARGET}` first), or pass --force to "
            "lift the hold now\n",
        ),
    ),
    (
        "resume",
        (
            0,
            f"{_WU} resumed (phase Paused; new units start on the operator's next pass; it still "
            f"holds after its canary until `weightroll promote {_TARGET}`)\n",
            "",
        ),
    ),
    (
        "resume",
        (
            0,
            f"{_WU} is not paused (phase Paused); it holds after its canary: run "
            f"`weightroll promote {_TARGET}`; nothing changed\n",
            "",
        ),
    ),
    (
        "promote",
        (
            0,
            f"{_WU} promoted (phase Paused; the remaining units follow, maxUnavailable at a "
            "time)\n",
            "",
        ),
    ),
    (
        "promote",
        (
            0,
            f"{_WU} already promoted (spec.strategy.pauseAfterCanary is false; phase Paused); "
            "nothing changed\n",
            "",
        ),
    ),
]


def _patches(emulator: FleetEmulator) -> list[tuple[str, str, str, Any]]:
    return [
        (r.method.value, r.url.path, r.headers.get("Content-Type", ""), json.loads(r.text))
        for r in emulator
        if r.method == kmock.method.PATCH
    ]


@contextlib.asynccontextmanager
async def _cluster(
    tmp_path: Path, body: dict[str, Any]
) -> AsyncIterator[tuple[FleetEmulator, aiohttp.ClientSession, Path]]:
    """kmock serving ``body``, a client session to it, and a kubeconfig that points at it."""
    async with fleet_emulator() as (emulator, url), aiohttp.ClientSession(base_url=url) as http:
        async with http.post(WU_PATH, json=body) as resp:
            assert resp.status < 400, await resp.text()
        yield emulator, http, write_kubeconfig(tmp_path, url)


@pytest.mark.asyncio
async def test_each_verb_sends_one_merge_patch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _cluster(tmp_path, _held_after_canary()) as (emulator, http, config):

        async def run(*argv: str) -> tuple[int, str, str]:
            rc = await asyncio.to_thread(main, [*argv, NAME, "-n", NS, "--kubeconfig", str(config)])
            out = capsys.readouterr()
            return rc, out.out, out.err

        async def stored() -> dict[str, Any]:
            async with http.get(f"{WU_PATH}/{NAME}") as resp:
                body: dict[str, Any] = await resp.json()
                return body

        for verb, expected in STEPS:
            assert await run(verb) == expected, verb
        path = f"{WU_PATH}/{NAME}"
        merge = "application/merge-patch+json"
        assert _patches(emulator) == [
            ("PATCH", path, merge, {"spec": {"paused": True}}),
            ("PATCH", path, merge, {"spec": {"paused": False}}),
            (
                "PATCH",
                path,
                merge,
                {
                    "spec": {"strategy": {"pauseAfterCanary": False}},
                    "metadata": {"resourceVersion": "1"},
                },
            ),
        ]
        spec = (await stored())["spec"]
        assert spec["paused"] is False
        assert spec["strategy"] == {"canary": 1, "pauseAfterCanary": False}  # canary kept


@pytest.mark.asyncio
async def test_promote_refuses_before_the_hold_and_not_found_names_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    running = _held_after_canary()
    running["status"]["phase"] = "Progressing"
    running["status"]["conditions"] = [{"type": "Paused", "status": "False", "reason": "NotPaused"}]
    async with _cluster(tmp_path, running) as (emulator, _, config):
        argv = ["-n", NS, "--kubeconfig", str(config)]

        assert await asyncio.to_thread(main, ["promote", NAME, *argv]) == 1
        assert capsys.readouterr().err == (
            f"weightroll promote: {NS}/{NAME} is not holding after its canary (the status shows "
            f"Paused=False NotPaused, not CanaryComplete; wait until `weightroll status {NAME} "
            f"-n {NS}` shows it), or pass --force to lift the hold now\n"
        )
        for verb in ("pause", "resume", "promote"):
            assert await asyncio.to_thread(main, [verb, "nope", *argv]) == 1
            assert capsys.readouterr().err == (
                f"weightroll {verb}: WeightUpdate {NS}/nope not found; list them with "
                f"`kubectl get weightupdates -n {NS}` (or -A), or pass -n NAMESPACE\n"
            )
        assert _patches(emulator) == []  # neither the refusal nor the unknown name wrote

        assert await asyncio.to_thread(main, ["promote", NAME, "--force", *argv]) == 0
        assert capsys.readouterr().out.startswith(f"weightupdate {NS}/{NAME} promoted (phase ")
        assert [p[3]["spec"] for p in _patches(emulator)] == [
            {"strategy": {"pauseAfterCanary": False}}
        ]


def test_unreachable_api_server_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_kubeconfig(tmp_path, "http://127.0.0.1:9")  # discard port: connection refused
    assert main(["pause", NAME, "--kubeconfig", str(config)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("weightroll pause: cannot reach the API server http://127.0.0.1:9")


_FORBIDDEN = (
    f"weightroll pause: 403: PATCH {WU_PATH}/{NAME}: no; your user may not get or patch "
    f"weightupdates.weightroll.io in namespace {NS} (check: kubectl auth can-i patch "
    f"weightupdates.weightroll.io -n {NS})\n"
)
#: 409: the API server refused promote's resourceVersion precondition (the object changed).
_CHANGED = (
    f"weightroll promote: {NS}/{NAME} changed between the check and the patch; run it again\n"
)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("code", "verb", "expected"), [(403, "pause", _FORBIDDEN), (409, "promote", _CHANGED)]
)
async def test_a_refused_patch_is_one_line_with_the_fix(
    code: int, verb: str, expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with _cluster(tmp_path, _held_after_canary()) as (emulator, _, config):
        emulator[kmock.method.PATCH] << code << {"kind": "Status", "code": code, "message": "no"}
        argv = [verb, NAME, "-n", NS, "--kubeconfig", str(config)]
        assert await asyncio.to_thread(main, argv) == 1
        assert capsys.readouterr().err == expected
