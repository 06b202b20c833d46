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
import aiohttp.web
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
    assert err == (
        "weightroll pause: The connection to the server 127.0.0.1:9 was refused - did you "
        "specify the right host or port?\n"
    ), "kubectl's words, not a library's repr"


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


#: The API server's clock in the test below: years before this machine's.
_SERVER_DATE = "Tue, 04 Feb 2020 05:06:07 GMT"


@pytest.mark.asyncio
@pytest.mark.parametrize(("verb", "stamp"), [("retry", "retriedAt"), ("abort", "abortedAt")])
async def test_abort_and_retry_stamp_the_api_servers_time(
    verb: str, stamp: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27 item 12: ``retriedAt`` came from the CLI machine's clock, which the operator
    then compared with the attempt start times it stamped with its own; a skewed laptop left
    failed pods failed (or retried newer attempts). The stamp is the API server's ``Date``."""
    body = make_weightupdate(NAME, "v3", namespace=NS)
    halted = verb == "retry"
    body["status"] = {"phase": "Failed" if halted else "Progressing", "targetVersion": "v3"}
    if halted:
        body["status"] |= {"abortedAt": "2020-02-04T05:00:00Z", "abortReason": "AbortedByUser"}
    patches: list[dict[str, Any]] = []

    async def get(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response(body, headers={"Date": _SERVER_DATE})

    async def patch(request: aiohttp.web.Request) -> aiohttp.web.Response:
        patches.append(await request.json())
        return aiohttp.web.json_response(body, headers={"Date": _SERVER_DATE})

    app = aiohttp.web.Application()
    app.router.add_get(f"{WU_PATH}/{NAME}", get)
    app.router.add_patch(f"{WU_PATH}/{NAME}/status", patch)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        config = write_kubeconfig(tmp_path, f"http://127.0.0.1:{port}")
        argv = [verb, NAME, "-n", NS, "--kubeconfig", str(config)]
        assert await asyncio.to_thread(main, argv) == 0, capsys.readouterr().err
    finally:
        await runner.cleanup()
    assert [p["status"][stamp] for p in patches] == ["2020-02-04T05:06:07Z"]
