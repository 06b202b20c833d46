"""The system-package step of ``make demo`` and CI prints one line, not apt's package log.

``scripts/quietly.sh`` (sourced by ``scripts/system-deps.sh``) runs a noisy command with its
output in a log: one ``LABEL … done`` line on success, ``… failed`` plus the log's tail and path
on failure, with the command's exit status (CI's ``.ci/run`` stops there). ``system-deps.sh``
itself runs against a fake ``apt-get`` on a PATH of its own, as root (a fake ``id``), with a fake
``tee`` so the deb-src step never writes to this machine's ``/etc/apt``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUIETLY = ROOT / "scripts" / "quietly.sh"
SYSTEM_DEPS = ROOT / "scripts" / "system-deps.sh"
#: What a fresh machine's apt prints: a line per package.
NOISE = 'for i in $(seq 1 200); do echo "Unpacking package-$i"; done'


def _quietly(tmp_path: Path, body: str, **env: str) -> subprocess.CompletedProcess[str]:
    script = f'source "{QUIETLY}"\nnoisy() {{ {body}; }}\nquietly "installing (go, etcd)" noisy'
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path), **env},
        timeout=60,
        check=False,
    )


def test_success_is_one_line_and_leaves_no_log(tmp_path: Path) -> None:
    done = _quietly(tmp_path, NOISE)
    assert (done.returncode, done.stdout, done.stderr) == (0, "installing (go, etcd) … done\n", "")
    assert list(tmp_path.iterdir()) == []


def test_failure_shows_the_logs_tail_and_keeps_the_log(tmp_path: Path) -> None:
    apt_error = "echo 'E: Unable to locate package etcd-server'"
    done = _quietly(tmp_path, f"{NOISE}; {apt_error}; return 100")
    assert done.returncode == 100
    assert done.stdout == "installing (go, etcd) … failed\n"
    tail = done.stderr.splitlines()
    assert tail[-2] == "E: Unable to locate package etcd-server"
    assert "Unpacking package-1\n" not in done.stderr  # the tail, not the whole log
    (log,) = tmp_path.iterdir()
    assert tail[-1] == f"(exit 100; full log: {log})"
    assert log.read_text().count("Unpacking") == 200


def test_verbose_shows_the_commands_own_output(tmp_path: Path) -> None:
    done = _quietly(tmp_path, NOISE, WEIGHTROLL_VERBOSE="1")
    assert done.returncode == 0
    assert done.stdout.startswith("installing (go, etcd) …\nUnpacking package-1\n")


def _fake_root(tmp_path: Path, apt_status: int) -> dict[str, str]:
    """A PATH with only the coreutils the script uses, a fake root ``id`` and a fake apt-get."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "mktemp", "tail", "rm", "grep", "sed", "cat", "seq"):
        real = shutil.which(tool)
        if real is None:
            pytest.skip(f"{tool} is not installed")
        (bin_dir / tool).symlink_to(real)
    fakes = {
        "id": "echo 0",
        "tee": "cat >/dev/null",  # the deb-src file: never written to this machine
        "apt-get": (
            f'echo "$*" >>"{tmp_path}/apt-calls"; {NOISE.replace("package", "$1")}; '
            f"exit {apt_status}"
        ),
    }
    for name, body in fakes.items():
        fake = bin_dir / name
        fake.write_text(f"#!{shutil.which('bash')}\n{body}\n")
        fake.chmod(0o755)
    return {"PATH": str(bin_dir), "TMPDIR": str(tmp_path), "HOME": str(tmp_path)}


@pytest.mark.parametrize("apt_status", [0, 100], ids=["installed", "apt-failed"])
def test_system_deps_prints_one_line_for_apt(tmp_path: Path, apt_status: int) -> None:
    env = _fake_root(tmp_path, apt_status)
    done = subprocess.run(
        [env["PATH"] + "/bash", str(SYSTEM_DEPS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    calls = (tmp_path / "apt-calls").read_text().splitlines()
    assert calls[0] == "update -qq"
    label = "system-deps: installing system packages (promtool, go, "
    assert done.stdout.startswith(label), done.stdout + done.stderr
    assert "etcd, etcdctl, openssl, make, kubectl, curl" in done.stdout
    assert "Unpacking" not in done.stdout
    if apt_status == 0:
        assert done.returncode == 0, done.stderr
        assert done.stdout.endswith(") … done\n") and done.stdout.count("\n") == 1
        assert calls[1].startswith("install -y -qq --no-install-recommends prometheus golang-go")
    else:
        assert done.returncode == apt_status
        assert done.stdout.endswith(") … failed\n")
        assert "full log:" in done.stderr
        assert calls == ["update -qq"], "a failed update stops before the install"
