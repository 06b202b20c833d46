"""Where an update may read: its source and manifest stay inside the model directory.

A request names paths; the ranks open them. ``..`` segments and symlinks could take a rank out of
the model volume (issue 28 item 8: ``source.uri`` was not confined, and ``--source-root`` was
escapable), so the agent resolves each path and refuses one whose real path lies outside the
jail, before anything is read or accepted. Only paths are resolved; no file is opened.

Limitation: the check and the ranks' reads are separate moments; a symlink replaced inside the
jail in between is not seen here (a writer of the model volume is trusted unless the update pins
its manifest, docs/architecture.md "Threat model").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

from engine_agent.protocol import SourceSpec

__all__ = ["SourceRefused", "confine"]


class SourceRefused(ValueError):
    """A request's source names a path outside the model directory (HTTP 422 naming ``field``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def confine(source: SourceSpec, *, jail: str, where: str, local_path: Callable[[str], str]) -> None:
    """Refuse ``source`` unless it stays inside ``jail``: its real path, and for a directory the
    target of every symlink directly in it (the files a rank reads).

    Args:
        jail: the directory, as this process sees it.
        where: how a refusal names the jail.
        local_path: maps a pod-view path to where this process reads it.

    Raises:
        SourceRefused: naming ``source.uri`` or ``source.manifest``.
    """
    jail = os.path.realpath(jail)

    def inside(path: str) -> bool:
        return os.path.commonpath([jail, os.path.realpath(path)]) == jail

    for name, path in (("uri", source.path), ("manifest", source.manifest_path)):
        if path is None:
            continue
        field = f"source.{name}"
        local = local_path(path)
        if not inside(local):
            raise SourceRefused(
                field, f"{field} {path!r} lies outside {where} (symlinks and '..' resolved)"
            )
        escapes: list[str] = []
        if name == "uri" and os.path.isdir(local):
            # unreadable: nothing to list here, and the ranks fail reading it themselves
            with contextlib.suppress(OSError), os.scandir(local) as entries:
                escapes = [e.name for e in entries if e.is_symlink() and not inside(e.path)]
        if escapes:
            raise SourceRefused(
                field,
                f"{field} {path!r} holds {escapes[0]!r}, a symlink that leads outside {where}",
            )
