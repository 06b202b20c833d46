"""What users install: the wheel holds the product only, never the checkout's dev tooling.

Builds the real wheel (``pip wheel --no-deps`` of a copy of the tracked files, so the checkout is
left untouched) and reads it: only ``engine_agent`` and ``weightroll_operator`` are in it — no
``weightroll_dev`` (dev cluster, demos, tiny models). Then runs the wheel's CLI on its own
(``python -S``: no site-packages, so no editable install of this checkout can answer instead):
``--help`` lists no ``demo``/``dev`` command and both say that they need a checkout.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = {"engine_agent", "weightroll_operator"}
#: Offline with this environment's setuptools when it has one; else pip fetches the build backend.
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "--no-deps", "-q") + (
    ("--no-build-isolation",) if importlib.util.find_spec("setuptools") else ()
)


def _tracked_copy(dest: Path) -> Path:
    """The checkout's tracked files (or, outside git, the tree minus caches) under ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=60
    )
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            src = ROOT / name
            if name and src.is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name)
    else:
        shutil.copytree(
            ROOT,
            dest,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(".git", ".venv", ".cache", "build", "*.egg-info"),
        )
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    src = _tracked_copy(base / "weightroll")
    out = base / "out"
    done = subprocess.run(
        # "DIR/": a path, never a requirement name.
        [*PIP_WHEEL, f"{src}/", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("weightroll-*.whl")
    return found


def test_wheel_holds_the_product_packages_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == PRODUCT, sorted(tops)
    dev = [n for n in names if any(w in n for w in ("weightroll_dev", "devcluster", "demo"))]
    assert dev == [], dev
    assert not [n for n in names if n.endswith("tinymodels.py")]
    assert "engine_agent/vllm_extension.py" in names  # the product is there
    assert "weightroll_operator/cli.py" in names


def _installed_cli(wheel: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    if not site.is_dir():
        zipfile.ZipFile(wheel).extractall(site)
    return subprocess.run(
        [sys.executable, "-S", "-m", "weightroll_operator.cli", *args],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_installed_cli_neither_lists_nor_runs_dev_commands(wheel: Path, tmp_path: Path) -> None:
    helped = _installed_cli(wheel, tmp_path, "--help")
    assert helped.returncode == 0, helped.stderr
    # argparse lists one command per line, indented by four: "    NAME  help".
    listed = [ln.split()[0] for ln in helped.stdout.splitlines() if re.match(r"    [a-z]", ln)]
    assert "status" in listed and "lint" in listed, listed
    assert not {"demo", "dev", "operator", "agent"} & set(listed), listed
    for argv in (("demo",), ("dev", "up"), ("demo", "--engine")):
        done = _installed_cli(wheel, tmp_path, *argv)
        assert done.returncode == 2, (argv, done.stdout, done.stderr)
        assert f"weightroll {argv[0]}: a development command of the repository checkout" in (
            done.stderr
        ), done.stderr


def test_the_wheel_installs_one_command_per_role(wheel: Path) -> None:
    """Issue 31 item 2: the user's CLI (twice: kubectl runs it as a plugin) and one command per
    container, each pointing at a module of the wheel."""
    names = zipfile.ZipFile(wheel).namelist()
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    scripts = text.split("[console_scripts]")[1].split("[")[0]
    found = dict(
        (k.strip(), v.strip())
        for k, v in (ln.split("=") for ln in scripts.splitlines() if "=" in ln)
    )
    assert found == {
        "weightroll": "weightroll_operator.cli:main",
        "kubectl-weightroll": "weightroll_operator.cli:main",
        "weightroll-operator": "weightroll_operator.main:main",
        "weightroll-agent": "engine_agent.sidecar.main:main",
    }
    for target in found.values():
        assert target.split(":")[0].replace(".", "/") + ".py" in names
