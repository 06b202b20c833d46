"""What every wire model shares: camelCase JSON, no unknown fields, and the patterns of the
strings that travel (versions are label values, update ids DNS-like, manifest pins SHA-256)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, StringConstraints
from pydantic.alias_generators import to_camel

#: A weight version is also written as a label value on pods, so it follows label-value rules.
VERSION_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$"
#: Poison reason prefix of a rank whose live weights changed after its verified commit
#: (engine_agent/reload/guard.py); the agent holds the replica under this code.
STILL_TRUE_VIOLATED = "still_true_violated"
#: Update ids are chosen by the operator (``<cr-uid-prefix>-<version>``) or by a user.
UPDATE_ID_PATTERN = r"^[a-z0-9]([a-z0-9.-]{0,125}[a-z0-9])?$"
#: A pinned manifest: ``sha256:`` and the lower-case hex SHA-256 of the manifest file's bytes,
#: exactly as ``weightroll manifest`` prints it (``engine_agent.manifest.manifest_file_digest``).
MANIFEST_DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"

Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]
UpdateId = Annotated[str, StringConstraints(pattern=UPDATE_ID_PATTERN)]


class WireModel(BaseModel):
    """Base for every wire model: camelCase JSON, snake_case attributes, no unknown fields."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    def to_wire(self) -> dict[str, Any]:
        """Return the JSON-ready dict (camelCase keys, enums as strings, ``None`` kept)."""
        return self.model_dump(mode="json", by_alias=True)
