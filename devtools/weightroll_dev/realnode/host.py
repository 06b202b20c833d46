"""What a real node changes on the host, and how to take it back.

A kubelet and containerd are not confined by the network namespace alone: they run in the host's
mount namespace (the kubelet's volume mounts must be visible to containerd), write cgroups, host
directories and kernel settings. This module names each of those, records the host's state
before the bring-up and undoes the difference at ``stop``; :func:`footprint` is the snapshot a
test compares before ``up`` and after ``down``.

Invariants:
    * Only what did not exist before the bring-up is removed (a directory the host already had
      stays, with its content).
    * Kernel settings are restored to the values read before the kubelet started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HOST_PATHS",
    "KUBELET_SYSCTLS",
    "Footprint",
    "cgroup_dirs",
    "footprint",
    "read_sysctls",
    "remove_cgroup_tree",
    "remove_new_paths",
    "restore_sysctls",
    "unmount_under",
]

#: Kernel settings the kubelet 1.20 sets at start (``kubelet/cm/container_manager_linux.go``
#: ``setupKernelTunables``), in /proc/sys path form.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
)
#: Host directories the kubelet, containerd and the CNI plugins create outside their configured
#: roots (log symlinks, the flexvolume plugin dir, shim sockets, CNI result cache, opt plugins).
HOST_PATHS = (
    "/var/log/pods",
    "/var/log/containers",
    "/usr/libexec/kubernetes",
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/run/containerd",
    "/opt/containerd",
    "/etc/cni",
    "/opt/cni",
)
#: The cgroup the kubelet creates for pods in every hierarchy (cgroupfs driver, root "/").
KUBEPODS = "kubepods"
CGROUP_ROOT = Path("/sys/fs/cgroup")


def read_sysctls(names: tuple[str, ...] = KUBELET_SYSCTLS) -> dict[str, str]:
    return {name: (Path("/proc/sys") / name).read_text().strip() for name in names}


def restore_sysctls(saved: dict[str, str]) -> list[str]:
    """Write back ``saved``; return the settings that could not be written (with the error)."""
    failed = []
    for name, value in saved.items():
        path = Path("/proc/sys") / name
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as e:
            failed.append(f"{name}: {e}")
    return failed


def cgroup_dirs(name: str = KUBEPODS) -> list[Path]:
    """``name`` under each cgroup hierarchy root where it exists (v1 controllers and unified)."""
    if not CGROUP_ROOT.is_dir():
        return []
    found = []
    for hierarchy in sorted(CGROUP_ROOT.iterdir()):
        candidate = hierarchy / name
        if candidate.is_dir():
            found.append(candidate)
    # A pure cgroup v2 host has the groups directly under the root.
    if (CGROUP_ROOT / name).is_dir() and (CGROUP_ROOT / "cgroup.controllers").exists():
        found.append(CGROUP_ROOT / name)
    return found


def remove_cgroup_tree(root: Path) -> list[str]:
    """rmdir ``root`` and its child cgroups, deepest first; return those that stayed (busy)."""
    stuck = []
    dirs = [Path(d) for d, _, _ in os.walk(root)]
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
        except FileNotFoundError:
            continue
        except OSError as e:
            stuck.append(f"{d}: {e.strerror}")
    return stuck


def _mount_points() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        # Field 5 is the mount point, with spaces and the like escaped as octal.
        point = line.split()[4]
        points.append(point.encode().decode("unicode_escape"))
    return points


def unmount_under(roots: list[Path]) -> list[str]:
    """Lazily unmount every mount point at or under ``roots``, deepest first.

    Returns the mount points that could not be unmounted (with umount's message).
    """
    prefixes = [str(r.resolve()) for r in roots]
    points = [p for p in _mount_points() if any(p == r or p.startswith(r + "/") for r in prefixes)]
    failed = []
    for point in sorted(set(points), key=lambda p: p.count("/"), reverse=True):
        proc = subprocess.run(["umount", "-l", point], capture_output=True, text=True, check=False)
        if proc.returncode != 0 and "not mounted" not in proc.stderr:
            failed.append(f"{point}: {proc.stderr.strip()}")
    return failed


def remove_new_paths(existed_before: dict[str, bool]) -> None:
    """Remove each host path of ``existed_before`` that did not exist then and does now."""
    for path, existed in existed_before.items():
        if not existed:
            p = Path(path)
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.is_dir():
                shutil.rmtree(p, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a node may leave on the host, in comparable form."""

    mounts: frozenset[str]
    netns: frozenset[str]
    links: frozenset[str]
    addresses: frozenset[str]
    cgroups: frozenset[str]
    paths: frozenset[str]
    sysctls: tuple[tuple[str, str], ...]
    #: Command lines of processes that name ``marker`` (the node's state directory).
    processes: frozenset[str]

    def difference(self, later: Footprint) -> dict[str, list[str]]:
        """What ``later`` has that this one has not (and changed settings), per kind."""
        out: dict[str, list[str]] = {}
        for field in ("mounts", "netns", "links", "addresses", "cgroups", "paths", "processes"):
            added = sorted(getattr(later, field) - getattr(self, field))
            if added:
                out[field] = added
        changed = sorted(set(later.sysctls) - set(self.sysctls))
        if changed:
            out["sysctls"] = [f"{k}={v}" for k, v in changed]
        return out


def _ip_lines(*args: str) -> frozenset[str]:
    proc = subprocess.run(["ip", "-o", *args], capture_output=True, text=True, check=False)
    # Drop counters and ifindex-independent noise: keep the interface name and address.
    lines = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        if args[0] == "addr" and len(parts) >= 4:
            lines.add(f"{parts[1]} {parts[3]}")
        elif len(parts) >= 2:
            lines.add(parts[1].split("@")[0].rstrip(":"))
    return frozenset(lines)


def _processes(marker: str) -> frozenset[str]:
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if marker in cmdline:
                found.add(f"{entry.name} {cmdline.strip()}")
    return frozenset(found)


def footprint(marker: str) -> Footprint:
    """Snapshot the host state a real node touches; ``marker`` picks its processes."""
    netns_dir = Path("/run/netns")
    return Footprint(
        mounts=frozenset(_mount_points()),
        netns=frozenset(p.name for p in netns_dir.iterdir()) if netns_dir.is_dir() else frozenset(),
        links=_ip_lines("link"),
        addresses=_ip_lines("addr"),
        cgroups=frozenset(str(p) for p in cgroup_dirs()),
        paths=frozenset(p for p in HOST_PATHS if os.path.lexists(p)),
        sysctls=tuple(sorted(read_sysctls().items())),
        processes=_processes(marker),
    )
