"""``weightroll status`` for pipelines, against kmock: the exit status by outcome, ``-o json|yaml``
and its schema (generated from the StatusView model), ``--watch`` ending on a terminal phase or
at ``--timeout``, the namespace of the kubeconfig context, and the ``kubectl weightroll`` plugin
entry point run by the real kubectl.

The objects are the golden ones of ``test_status_view.py`` (statuses the operator writes).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import kmock
import pydantic
import pytest
import yaml
from weightroll_operator.api import v1alpha1 as api
from weightroll_operator.status_document import StatusView, view_schema
from weightroll_operator.status_view import Exit, main, outcome, view

from tests.harness.kube_fleet import FleetEmulator, fleet_emulator, write_kubeconfig
from tests.unit.weightroll_operator.test_status_view import (
    FAILED,
    FAILED_EVENTS,
    NS,
    RUNNING,
    SUCCEEDED,
)

REPO = Path(__file__).resolve().parents[3]
WU_PATH = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}"


def _with(body: dict[str, Any], **status: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["status"].update(status)
    return out


def _generation(body: dict[str, Any], generation: int) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["metadata"]["generation"] = generation
    return out


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (SUCCEEDED, Exit.SUCCEEDED),
        (FAILED, Exit.FAILED),
        (_with(FAILED, phase="RolledBack"), Exit.FAILED),
        (RUNNING, Exit.NOT_FINISHED),
        (_with(RUNNING, phase="Paused"), Exit.NOT_FINISHED),
        (_with(RUNNING, phase="RollingBack"), Exit.NOT_FINISHED),
        # generation 2 applied, the status still reports on generation 1: not this spec's result
        (_generation(SUCCEEDED, 2), Exit.NOT_FINISHED),
        (_generation(FAILED, 2), Exit.FAILED),  # observedGeneration 2 = generation 2
        ({k: v for k, v in SUCCEEDED.items() if k != "status"}, Exit.NOT_FINISHED),
    ],
    ids=[
        "succeeded",
        "failed",
        "rolled-back",
        "progressing",
        "paused",
        "rolling-back",
        "succeeded-for-an-older-generation",
        "failed-current-generation",
        "no-status",
    ],
)
def test_outcome_by_phase_and_generation(body: dict[str, Any], expected: Exit) -> None:
    assert outcome(body) is expected


def test_exit_statuses_are_distinct() -> None:
    assert len({int(e) for e in Exit}) == len(Exit)
    assert {Exit.SUCCEEDED, Exit.FAILED, Exit.NOT_FINISHED} == {0, 3, 4}


def _validate(doc: dict[str, Any]) -> None:
    """``doc`` is valid by the generated JSON Schema and by the model, and the model keeps it."""
    jsonschema.Draft202012Validator(view_schema()).validate(doc)
    assert StatusView.model_validate(doc).to_document() == doc


def test_json_view_golden_and_schema() -> None:
    events = [{**e, "count": 2 if e["reason"] == "UnitFailed" else 1} for e in FAILED_EVENTS]
    doc = view(_generation(FAILED, 2), events, last=2)
    _validate(doc)
    assert doc == {
        "schemaVersion": 1,
        "namespace": NS,
        "name": "llama-v3",
        "version": "v3",
        "generation": 2,
        "observedGeneration": 2,
        "current": True,
        "phase": "Failed",
        "result": "Failed",
        "exitCode": 3,
        "message": "Failed: 1/3 pods verified at v3; 1 failed; 1 stale; halted: "
        "FailureBudgetExceeded",
        "stableVersion": "v2",
        "replicas": {
            "total": 3,
            "updated": 1,
            "verified": 1,
            "draining": 0,
            "failed": 1,
            "stale": 1,
        },
        "conditions": [
            {
                "type": c["type"],
                "status": c["status"],
                "reason": c["reason"],
                "message": c["message"],
                "lastTransitionTime": "2026-11-30T10:00:00Z",
            }
            for c in FAILED["status"]["conditions"]
        ],
        "pods": [
            {
                "name": "llama-1",
                "state": "Failed",
                "version": "v3",
                "reason": "UpdateFailed: manifest_mismatch: up_proj",
                "unit": None,
                "step": None,
            },
            {
                "name": "llama-2",
                "state": "Pending",
                "version": None,
                "reason": None,
                "unit": None,
                "step": None,
            },
            {
                "name": "llama-0",
                "state": "Verified",
                "version": "v3",
                "reason": None,
                "unit": None,
                "step": None,
            },
        ],
        "events": [
            {
                "time": "2026-11-30T11:02:00Z",
                "type": "Warning",
                "reason": "FailureBudgetExceeded",
                "message": "Halted: 1 failed units exceed maxFailedReplicas 0",
                "count": 1,
            },
            {
                "time": "2026-11-30T11:02:00Z",
                "type": "Warning",
                "reason": "PhaseChanged",
                "message": "Phase changed from Progressing to Failed",
                "count": 1,
            },
        ],
    }


_BROKEN = {
    "an-undocumented-key": {"extra": 1},
    "an-exit-code-without-document": {"exitCode": 1},
    "an-unknown-phase": {"phase": "Done"},
    "a-string-for-a-number": {"exitCode": "3"},
    "a-missing-schema-version": {"schemaVersion": None},
    "a-negative-count": {"replicas": {**view(RUNNING, [])["replicas"], "failed": -1}},
}


@pytest.mark.parametrize("change", list(_BROKEN.values()), ids=list(_BROKEN))
def test_schema_and_model_reject_what_they_do_not_document(change: dict[str, Any]) -> None:
    doc = view(RUNNING, [])
    _validate(doc)
    broken = {k: v for k, v in {**doc, **change}.items() if v is not None}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(view_schema()).validate(broken)
    with pytest.raises(pydantic.ValidationError):
        StatusView.model_validate(broken)


def test_schema_is_generated_from_the_model() -> None:
    """Every key the command prints is required, none other allowed, at every level."""
    schema = view_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["title"] == "weightroll status -o json"
    assert schema["required"] == list(view(RUNNING, []))
    assert schema["additionalProperties"] is False
    for nested in schema["$defs"].values():
        if nested.get("type") == "object":
            assert nested["additionalProperties"] is False
            assert nested["required"] == list(nested["properties"])


# ---- the command against kmock ------------------------------------------------------------


async def _serve(http: aiohttp.ClientSession, body: dict[str, Any]) -> None:
    async with http.post(WU_PATH, json=body) as resp:
        assert resp.status < 400, await resp.text()


async def _set_status(http: aiohttp.ClientSession, name: str, status: dict[str, Any]) -> None:
    async with http.patch(
        f"{WU_PATH}/{name}/status",
        json={"status": status},
        headers={"Content-Type": "application/merge-patch+json"},
    ) as resp:
        assert resp.status < 400, await resp.text()


def _gets(emulator: FleetEmulator, name: str) -> int:
    return sum(
        1 for r in emulator if r.method == kmock.method.GET and r.url.path == f"{WU_PATH}/{name}"
    )


async def _until_polled(emulator: FleetEmulator, name: str, times: int) -> None:
    """Until the command has read the object ``times`` times (no wall-clock assertion)."""
    while _gets(emulator, name) < times:
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
@pytest.mark.parametrize("output", ["json", "yaml"])
async def test_output_document_against_kmock(
    output: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with fleet_emulator() as (_, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, SUCCEEDED)
        config = write_kubeconfig(tmp_path, url)
        argv = ["llama-v2", "-n", NS, "--kubeconfig", str(config), "-o", output]
        rc = await asyncio.to_thread(main, argv)
    out = capsys.readouterr()
    assert (rc, out.err) == (0, "")
    doc = json.loads(out.out) if output == "json" else yaml.safe_load(out.out)
    _validate(doc)
    assert doc == view(SUCCEEDED, [])


@pytest.mark.asyncio
@pytest.mark.parametrize(("final", "code"), [("Succeeded", 0), ("Failed", 3), ("RolledBack", 3)])
async def test_watch_ends_on_a_terminal_phase(
    final: str, code: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Progressing, then Paused, then ``final``: the watch reports each and exits by ``final``."""
    async with fleet_emulator() as (emulator, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, RUNNING)
        config = write_kubeconfig(tmp_path, url)
        argv = ["llama-v2", "-n", NS, "--kubeconfig", str(config), "--watch", "--interval", "0.02"]
        argv += ["-o", "json"]
        command = asyncio.create_task(asyncio.to_thread(main, argv))
        await _until_polled(emulator, "llama-v2", 2)
        assert not command.done()  # Progressing does not end the watch
        await _set_status(http, "llama-v2", {"phase": "Paused", "message": "Paused: held"})
        polled = _gets(emulator, "llama-v2")
        await _until_polled(emulator, "llama-v2", polled + 2)
        assert not command.done()  # nor does Paused
        await _set_status(http, "llama-v2", {"phase": final, "message": f"{final}: done"})
        rc = await asyncio.wait_for(command, timeout=60)
    out = capsys.readouterr()
    assert rc == code
    progress = out.err.splitlines()
    assert progress[0].startswith("Progressing: 1/4 updated, 1 verified, 0 failed - Progressing")
    assert progress[1] == "Paused: 1/4 updated, 1 verified, 0 failed - Paused: held"
    assert progress[-1] == f"{final}: 1/4 updated, 1 verified, 0 failed - {final}: done"
    doc = json.loads(out.out)
    assert (doc["phase"], doc["exitCode"]) == (final, code)


@pytest.mark.asyncio
async def test_watch_waits_for_the_current_generation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Succeeded status about generation 1 while generation 2 is applied does not end it."""
    async with fleet_emulator() as (emulator, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, _generation(SUCCEEDED, 2))
        config = write_kubeconfig(tmp_path, url)
        argv = ["llama-v2", "-n", NS, "--kubeconfig", str(config), "-w", "--interval", "0.02"]
        command = asyncio.create_task(asyncio.to_thread(main, argv))
        await _until_polled(emulator, "llama-v2", 3)
        assert not command.done()
        await _set_status(http, "llama-v2", {"observedGeneration": 2})
        rc = await asyncio.wait_for(command, timeout=60)
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.startswith("Succeeded (status of an older generation): 2/2 updated")
    assert "\nSucceeded: 2/2 updated" in out.out
    assert "Phase:     Succeeded" in out.out


@pytest.mark.asyncio
async def test_watch_timeout_exits_not_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with fleet_emulator() as (_, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, RUNNING)
        config = write_kubeconfig(tmp_path, url)
        argv = ["llama-v2", "-n", NS, "--kubeconfig", str(config), "--timeout", "0.2"]
        argv += ["--interval", "0.05"]
        rc = await asyncio.to_thread(main, argv)
    out = capsys.readouterr()
    assert rc == Exit.NOT_FINISHED
    assert out.err == (
        f"weightroll status: timed out after 0.2 s; {NS}/llama-v2 is still Progressing (exit 4)\n"
    )
    assert "Phase:     Progressing" in out.out


def _context_kubeconfig(tmp_path: Path, url: str, namespace: str | None) -> Path:
    """``write_kubeconfig`` with a namespace on its context (what `kubens` sets)."""
    path = write_kubeconfig(tmp_path, url)
    doc = yaml.safe_load(path.read_text())
    doc["contexts"].append(
        {"name": "other", "context": {"cluster": "kmock", "user": "me", "namespace": "elsewhere"}}
    )
    if namespace is not None:
        doc["contexts"][0]["context"]["namespace"] = namespace
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.asyncio
async def test_namespace_defaults_to_the_context_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with fleet_emulator() as (_, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, SUCCEEDED)
        config = _context_kubeconfig(tmp_path, url, NS)
        rc = await asyncio.to_thread(main, ["llama-v2", "--kubeconfig", str(config)])
        assert (rc, capsys.readouterr().err) == (0, "")
        # --context picks that context's namespace; -n overrides either
        rc = await asyncio.to_thread(
            main, ["llama-v2", "--kubeconfig", str(config), "--context", "other"]
        )
        assert rc == 1
        assert "WeightUpdate elsewhere/llama-v2 not found" in capsys.readouterr().err
        rc = await asyncio.to_thread(
            main, ["llama-v2", "--kubeconfig", str(config), "--context", "other", "-n", NS]
        )
        assert (rc, capsys.readouterr().err) == (0, "")
        # no namespace on the context: default, as kubectl
        (tmp_path / "bare").mkdir()
        bare = _context_kubeconfig(tmp_path / "bare", url, None)
        rc = await asyncio.to_thread(main, ["llama-v2", "--kubeconfig", str(bare)])
        assert rc == 1
        assert "WeightUpdate default/llama-v2 not found" in capsys.readouterr().err


@pytest.mark.asyncio
async def test_control_verbs_use_the_context_namespace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightroll_operator.control import main as control_main

    async with fleet_emulator() as (_, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, RUNNING)
        config = _context_kubeconfig(tmp_path, url, NS)
        rc = await asyncio.to_thread(
            control_main, ["pause", "llama-v2", "--kubeconfig", str(config)]
        )
        assert rc == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith(f"weightupdate {NS}/llama-v2 paused")


def _plugin_on_path(tmp_path: Path) -> dict[str, str]:
    """An executable ``kubectl-weightroll`` built from pyproject's entry point, as pip would."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kubectl-weightroll"] == scripts["weightroll"]
    module, func = scripts["kubectl-weightroll"].split(":")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    plugin = bindir / "kubectl-weightroll"
    plugin.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"
    )
    plugin.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.asyncio
async def test_kubectl_runs_the_plugin(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (scripts/system-deps.sh installs it)")
    env = _plugin_on_path(tmp_path)
    async with fleet_emulator() as (_, url), aiohttp.ClientSession(base_url=url) as http:
        await _serve(http, FAILED)
        config = write_kubeconfig(tmp_path, url)
        argv = [kubectl, "weightroll", "status", "llama-v3", "-n", NS, "--kubeconfig", str(config)]
        proc = await asyncio.to_thread(
            subprocess.run,
            [*argv, "-o", "json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        helped = await asyncio.to_thread(
            subprocess.run,
            [kubectl, "weightroll", "--help"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == Exit.FAILED, proc.stderr
    assert json.loads(proc.stdout)["result"] == "Failed"
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: kubectl weightroll")
