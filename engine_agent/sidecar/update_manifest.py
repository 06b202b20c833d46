"""A file update's manifest: loaded and checked before the drain, and checked again before the
commit that it is still the one published.

Before the drain (:func:`preflight`) the agent reads the manifest the update names — against
``source.manifestDigest`` when pinned, and with ``--manifest-public-key`` only when its
signature verifies over exactly the bytes read — and checks that it was written for the
update's version (and, for a sparse patch, for its base version). A swapped or wrong manifest
therefore writes nothing. Before the commit (:func:`manifest_unchanged`) it reads it again: a
manifest re-published while the update ran means the ranks hold bytes of a superseded
checkpoint, and the update fails.
"""

from __future__ import annotations

import asyncio

from engine_agent.manifest import Manifest, ManifestError, load_manifest
from engine_agent.protocol import UpdateMode, UpdateRequest
from engine_agent.sidecar.config import AgentConfig
from engine_agent.sidecar.confinement import SourceRefused
from engine_agent.sidecar.rounds import Problem
from engine_agent.sidecar.signing import (
    ManifestSignatureInvalid,
    ManifestVerifier,
    signature_source,
    unsigned_update,
)

__all__ = ["ManifestRefused", "manifest_unchanged", "preflight"]


class ManifestRefused(Exception):
    """The update's manifest may not be loaded from; ``problems`` say why."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(map(str, problems)))
        self.problems = problems


async def preflight(
    config: AgentConfig, request: UpdateRequest
) -> tuple[Manifest | None, str | None]:
    """Load and check ``request``'s manifest before the drain.

    Returns:
        The manifest (``None`` when the update names none) and the pin the ranks check their
        own read against: the update's, or (signed) that of the bytes whose signature verified.

    Raises:
        ManifestRefused: unreadable, pin or signature wrong, or written for another version.
    """
    manifest_path = request.source.manifest_path
    try:
        if manifest_path is not None:
            manifest, pin = await _load(config, request, manifest_path)
        elif config.manifest_public_key is not None:
            raise unsigned_update(config.manifest_public_key)
        else:
            return None, request.source.manifest_digest
    except ManifestError as e:
        raise ManifestRefused([Problem(e.code, str(e))]) from e
    problems = _version_problems(manifest, request)
    if problems:
        raise ManifestRefused(problems)
    return manifest, pin


def _version_problems(manifest: Manifest, request: UpdateRequest) -> list[Problem]:
    problems: list[Problem] = []
    if manifest.version is not None and manifest.version != request.version:
        problems.append(
            Problem(
                "manifest_version_mismatch",
                f"manifest is for version {manifest.version} but the update is to "
                f"{request.version}",
            )
        )
    if request.mode is UpdateMode.SPARSE and manifest.base_version != request.base_version:
        problems.append(
            Problem(
                "manifest_base_mismatch",
                f"manifest applies to base version {manifest.base_version} but the update "
                f"says {request.base_version}",
            )
        )
    return problems


async def _load(
    config: AgentConfig, request: UpdateRequest, manifest_path: str
) -> tuple[Manifest, str | None]:
    """Load the update's manifest (and, with a public key, verify its signature).

    With source.manifestDigest the bytes parsed are the bytes hashed against the pin (and
    whose signature is checked)."""
    local, pin = config.local_path(manifest_path), request.source.manifest_digest
    key = config.manifest_public_key
    if key is None:
        return await asyncio.to_thread(load_manifest, local, pinned=pin), pin
    try:  # the .sig must stay in the model directory too
        config.check_source(signature_source(request.source))
    except SourceRefused as e:
        raise ManifestSignatureInvalid(str(e)) from e
    verifier = ManifestVerifier(key)
    return await asyncio.to_thread(
        verifier.load_manifest, local, version=request.version, pinned=pin
    )


async def manifest_unchanged(
    config: AgentConfig, request: UpdateRequest, digest: str | None
) -> list[Problem]:
    """The manifest the ranks verified against (``digest``) is still the one published (not
    re-published while the update ran); otherwise the replica holds bytes of a superseded
    checkpoint. An update that names no manifest has nothing to re-check."""
    manifest_path = request.source.manifest_path
    if manifest_path is None:
        return []
    try:
        now = await asyncio.to_thread(load_manifest, config.local_path(manifest_path))
    except ManifestError as e:
        return [Problem("manifest_changed", f"the manifest cannot be read any more: {e}")]
    if now.digest != digest:
        return [
            Problem(
                "manifest_changed",
                f"the manifest of {request.source.uri} was re-published during the update "
                f"(digest {str(digest)[:12]} -> {now.digest[:12]})",
            )
        ]
    return []
