"""Pod pieces for the real node: run the checkout's Python in a pod without copying it.

A pod on the tiny image (:data:`~weightroll_dev.realnode.images.TINY_IMAGE`) sees the host's
programs through read-only hostPath mounts at identical paths: ``/usr``, the interpreter's
installation (the prefix ``pyvenv.cfg`` names), the virtualenv and the checkout. That is how
a vLLM pod will run on the node (torch and vLLM live in the virtualenv, several GiB that no
image layer needs to carry).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["host_python_mounts", "venv_interpreter_prefix"]


def venv_interpreter_prefix(venv: Path) -> Path:
    """The installation prefix of the interpreter ``venv`` was made from (``home``'s parent).

    Raises:
        ValueError: ``venv`` has no ``pyvenv.cfg`` with a ``home`` line.
    """
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        for line in cfg.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and key.strip() == "home":
                return Path(value.strip()).parent
    raise ValueError(f"{cfg} names no interpreter home (not a virtualenv?)")


def host_python_mounts(
    venv: Path, checkout: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(volumes, volumeMounts)`` that let a tiny-image pod run ``venv``'s Python on ``checkout``.

    A path already inside another mounted path is not mounted twice (a system interpreter under
    ``/usr`` needs no mount of its own).
    """
    wanted = [Path("/usr"), venv_interpreter_prefix(venv), venv.resolve(), checkout.resolve()]
    paths: list[Path] = []
    for path in sorted(set(wanted), key=lambda p: len(p.parts)):
        if not any(path == p or path.is_relative_to(p) for p in paths):
            paths.append(path)
    volumes = [
        {"name": f"host-{i}", "hostPath": {"path": str(p), "type": "Directory"}}
        for i, p in enumerate(paths)
    ]
    mounts = [
        {"name": f"host-{i}", "mountPath": str(p), "readOnly": True} for i, p in enumerate(paths)
    ]
    return volumes, mounts
