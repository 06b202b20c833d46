"""The bearer tokens that open the agent's routes (the operator's, the trainers')."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

__all__ = ["TokenFile"]

logger = logging.getLogger(__name__)


class TokenFile:
    """Bearer tokens (one per line) read from a file, re-read when its mtime or size changes.

    Raises:
        ValueError: at construction, when the file is missing or empty (the agent must not
            start without a token).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[float, int] | None = None
        self._tokens: tuple[bytes, ...] = ()
        self._load()
        if not self._tokens:
            raise ValueError(f"token file {str(self.path)!r} is empty")

    def _load(self) -> None:
        try:
            stat = self.path.stat()
            stamp = (stat.st_mtime, stat.st_size)
            if stamp != self._stamp:
                lines = self.path.read_bytes().splitlines()
                self._tokens = tuple(t.strip() for t in lines if t.strip())
                self._stamp = stamp
        except OSError as e:
            if self._stamp is None:
                raise ValueError(f"cannot read token file {str(self.path)!r}: {e}") from e
            logger.error("Kept the previous token: cannot read %s: %s", self.path, e)

    def matches(self, presented: bytes) -> bool:
        """Whether ``presented`` is one of the tokens (each compared in constant time)."""
        self._load()
        hits = [hmac.compare_digest(presented, token) for token in self._tokens]
        return bool(presented) and any(hits)
