"""Per-shard coverage ledger (engine-reload.md R1/R2): pure, no torch.

Completion is decided by **set coverage of shard keys**, never by tensor names or element
counts (gap 2 of the mission): a fused QKV that received only ``q`` is incomplete because
``[k]`` and ``[v]`` are missing, whatever the element count says; a duplicated ``q`` is refused
before it is written and never advances completion.

A :class:`ShardKey` is ``(module, param, shard)`` where ``shard`` is the loader's shard selector:
``"*"`` for an unsharded parameter, ``"q"|"k"|"v"`` for QKV, ``"0"|"1"`` for merged column
linears, ``"e<expert>:w1|w2|w3"`` for fused MoE experts (only experts this rank owns). TP
slicing is rank-local (each rank's ledger describes its own slice), so the same key set on
every TP rank means the ranks agree on the plan. Pipeline stages (their own layers only) and
expert-parallel ranks (their own experts only) legitimately expect different key sets; the
sidecar compares hashes only among ranks of one ``(pp, ep)`` group.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine_agent.errors import CoverageIncomplete, DuplicateShard, UnknownTensor

__all__ = ["WHOLE", "CoverageLedger", "ShardKey", "coverage_hash"]

#: Shard selector of a parameter that is loaded in one piece.
WHOLE = "*"


@dataclass(frozen=True, slots=True, order=True)
class ShardKey:
    module: str
    param: str
    shard: str = WHOLE

    def __str__(self) -> str:
        base = f"{self.module}.{self.param}" if self.module else self.param
        return base if self.shard == WHOLE else f"{base}[{self.shard}]"


def coverage_hash(keys: Iterable[ShardKey]) -> str:
    """SHA-256 over the sorted key strings: equal exactly when two ranks expect the same set."""
    digest = hashlib.sha256()
    for key in sorted(str(k) for k in keys):
        digest.update(key.encode())
        digest.update(b"\n")
    return digest.hexdigest()


class CoverageLedger:
    """What one rank must receive in one session, and what it has received.

    Args:
        required: module name -> the shard keys that module needs before it may be processed.
        optional: ``(module, param)`` pairs that may arrive but are not required (e.g.
            attention scales that only quantized checkpoints carry).
    """

    def __init__(
        self,
        required: Mapping[str, frozenset[ShardKey]],
        optional: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        self._required = {m: keys for m, keys in required.items() if keys}
        self._known = frozenset(k for keys in self._required.values() for k in keys)
        self._optional = optional
        self._received: dict[str, set[ShardKey]] = {}
        self.duplicates: list[ShardKey] = []

    # -- planning ---------------------------------------------------------------------------

    @property
    def modules(self) -> frozenset[str]:
        return frozenset(self._required)

    def in_scope(self, module: str) -> bool:
        """True when the session may write ``module`` (required or optional)."""
        return module in self._required or any(m == module for m, _ in self._optional)

    @property
    def required_count(self) -> int:
        return len(self._known)

    @property
    def received_count(self) -> int:
        return sum(len(v) for v in self._received.values())

    def required_hash(self) -> str:
        return coverage_hash(self._known)

    def received_hash(self) -> str:
        return coverage_hash(k for keys in self._received.values() for k in keys)

    def check(self, keys: Iterable[ShardKey]) -> None:
        """Validate a batch of keys about to be written, before any byte is written.

        Raises:
            DuplicateShard: a key was already received in this session or repeats in the batch
                (the duplicate is remembered and reported at finish).
            UnknownTensor: a key belongs to no required or optional parameter of this session.
        """
        seen: set[ShardKey] = set()
        for key in keys:
            if key in seen or key in self._received.get(key.module, ()):
                self.duplicates.append(key)
                raise DuplicateShard(
                    f"shard {key} was already loaded in this session; each shard may be sent "
                    "once per update (the second write was refused)",
                    field=str(key),
                )
            seen.add(key)
            if key not in self._known and (key.module, key.param) not in self._optional:
                raise UnknownTensor(
                    f"shard {key} is not part of this update (outside its scope or not a "
                    "parameter of this model)",
                    field=str(key),
                )

    # -- recording --------------------------------------------------------------------------

    def record(self, key: ShardKey) -> None:
        """Record one written key (already validated by :meth:`check`)."""
        received = self._received.setdefault(key.module, set())
        if key in received:
            self.duplicates.append(key)
            raise DuplicateShard(f"shard {key} was already loaded in this session", field=str(key))
        received.add(key)

    def is_complete(self, module: str) -> bool:
        """True when every required key of ``module`` has arrived (arrived ⊇ required)."""
        required = self._required.get(module, frozenset())
        return required <= self._received.get(module, set())

    def received(self) -> list[ShardKey]:
        """Every key recorded so far, sorted."""
        return sorted(k for keys in self._received.values() for k in keys)

    def touched(self) -> frozenset[str]:
        return frozenset(m for m, keys in self._received.items() if keys)

    def missing(self, modules: Iterable[str] | None = None) -> list[ShardKey]:
        """Required keys not received, for ``modules`` (default: every required module)."""
        names = self._required.keys() if modules is None else modules
        out: list[ShardKey] = []
        for module in names:
            out.extend(self._required.get(module, frozenset()) - self._received.get(module, set()))
        return sorted(out)

    def require_complete(self) -> None:
        """Raise :class:`CoverageIncomplete` listing the missing and duplicated shards."""
        missing = self.missing()
        if missing or self.duplicates:
            parts = []
            if missing:
                shown = ", ".join(str(k) for k in missing[:8])
                more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
                parts.append(f"{len(missing)} required shard(s) never arrived: {shown}{more}")
            if self.duplicates:
                parts.append("duplicate shard(s) refused: " + ", ".join(map(str, self.duplicates)))
            raise CoverageIncomplete("; ".join(parts))
