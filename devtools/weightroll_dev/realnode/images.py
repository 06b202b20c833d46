"""Container images for a node that reaches no registry: built here, imported into containerd.

Two images, each one uncompressed layer in an OCI image-layout archive that
``ctr images import`` loads:

* the **pause** image (the pod sandbox): Kubernetes' own ``build/pause/linux/pause.c`` from the
  same Debian source tarball as the binaries, linked statically;
* the **tiny** image: only empty top-level directories and the usr-merge symlinks (``bin``,
  ``lib``, ``lib64``, ``sbin`` -> ``usr/...``). A pod mounts the host's ``/usr`` read-only over
  it (hostPath) and runs host programs; so the same image later serves vLLM pods without copying
  a multi-GiB virtualenv into a layer.

Invariants: the archives are deterministic (fixed mtimes, sorted entries), so an unchanged input
gives the same image digest and a re-import is a no-op.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PAUSE_IMAGE",
    "TINY_IMAGE",
    "LayerEntry",
    "build_pause_binary",
    "pause_layer",
    "tiny_layer",
    "write_oci_archive",
]

PAUSE_IMAGE = "weightroll.local/pause:3.2"
TINY_IMAGE = "weightroll.local/tiny:1"
#: Where pause.c sits in the Kubernetes 1.20 source tree.
PAUSE_SOURCE = "build/pause/linux/pause.c"
USR_MERGE_LINKS = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64", "sbin": "usr/sbin"}
EMPTY_DIRS = ("dev", "etc", "proc", "sys", "tmp", "usr", "var", "run", "root")


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """One file system entry of a layer: a directory, a symlink or a regular file."""

    path: str
    #: ``dir``, ``symlink`` or ``file``.
    kind: str
    #: The symlink's target, or the file's content.
    target: str = ""
    content: bytes = b""
    mode: int = 0o755


def build_pause_binary(source_tarball: Path, out: Path) -> Path:
    """Compile Kubernetes' pause.c from ``source_tarball`` into a static binary at ``out``.

    Raises:
        RuntimeError: pause.c is not in the tarball, or gcc failed (its output in the message).
    """
    with tarfile.open(source_tarball) as tar:
        member = next((m for m in tar if m.name.endswith("/" + PAUSE_SOURCE)), None)
        if member is None:
            raise RuntimeError(f"{PAUSE_SOURCE} not found in {source_tarball}")
        handle = tar.extractfile(member)
        if handle is None:
            raise RuntimeError(f"{member.name} in {source_tarball} is not a regular file")
        source = handle.read()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / "pause.c"
        c_file.write_bytes(source)
        proc = subprocess.run(
            ["gcc", "-Os", "-static", "-DVERSION=v3.2-weightroll", "-o", str(out), str(c_file)],
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"building pause failed (apt gcc libc6-dev):\n{proc.stderr[-2000:]}")
    return out


def pause_layer(pause_binary: Path) -> list[LayerEntry]:
    return [LayerEntry("pause", "file", content=pause_binary.read_bytes(), mode=0o755)]


def tiny_layer() -> list[LayerEntry]:
    entries = [LayerEntry(name, "dir") for name in EMPTY_DIRS]
    entries += [LayerEntry(name, "symlink", target=t) for name, t in USR_MERGE_LINKS.items()]
    return entries


def _layer_tar(entries: list[LayerEntry]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(entries, key=lambda e: e.path):
            info = tarfile.TarInfo(entry.path)
            info.mtime = 0
            info.mode = entry.mode
            if entry.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif entry.kind == "symlink":
                info.type = tarfile.SYMTYPE
                info.linkname = entry.target
                tar.addfile(info)
            elif entry.kind == "file":
                info.size = len(entry.content)
                tar.addfile(info, io.BytesIO(entry.content))
            else:
                raise ValueError(f"unknown layer entry kind {entry.kind!r} for {entry.path}")
    return buf.getvalue()


def _blob(files: dict[str, bytes], data: bytes, media_type: str) -> dict[str, object]:
    digest = hashlib.sha256(data).hexdigest()
    files[f"blobs/sha256/{digest}"] = data
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def write_oci_archive(
    out: Path, image: str, entries: list[LayerEntry], entrypoint: list[str]
) -> Path:
    """Write ``image`` (one layer of ``entries``) as an OCI image-layout tar at ``out``.

    The index carries ``io.containerd.image.name`` so ``ctr images import`` names it ``image``.
    """
    layer = _layer_tar(entries)
    platform = {"architecture": "amd64", "os": "linux"}
    config = {
        **platform,
        "config": {"Entrypoint": entrypoint, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    files: dict[str, bytes] = {}
    layer_desc = _blob(files, layer, "application/vnd.oci.image.layer.v1.tar")
    config_json = json.dumps(config, sort_keys=True).encode()
    config_desc = _blob(files, config_json, "application/vnd.oci.image.config.v1+json")
    manifest = {"schemaVersion": 2, "config": config_desc, "layers": [layer_desc]}
    manifest_desc = _blob(
        files,
        json.dumps(manifest, sort_keys=True).encode(),
        "application/vnd.oci.image.manifest.v1+json",
    )
    tag = image.rsplit(":", 1)[1]
    manifest_desc["platform"] = platform
    manifest_desc["annotations"] = {
        "io.containerd.image.name": image,
        "org.opencontainers.image.ref.name": tag,
    }
    files["index.json"] = json.dumps({"schemaVersion": 2, "manifests": [manifest_desc]}).encode()
    files["oci-layout"] = b'{"imageLayoutVersion": "1.0.0"}'
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mtime = 0
            tar.addfile(info, io.BytesIO(files[name]))
    return out
