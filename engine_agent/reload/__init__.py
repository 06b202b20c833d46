"""Verified modulewise weight reload inside one vLLM rank.

Parts, pure first:
    * :mod:`.session` — the CLEAN/OPEN/DIRTY/POISONED state machine (gap 1).
    * :mod:`.coverage` — per-shard coverage ledger, duplicate refusal (gap 2).
    * :mod:`.identity` — storage and kernel identity records and their comparison.
    * :mod:`.derived` — derived-state refreshers, e.g. MLA ``W_UK_T``/``W_UV`` (gap 3).
    * :mod:`.inventory` — everything the kernels read, classified checkpoint / derived (with
      its refresher) / runtime, and checked as a whole at ``finish``.
    * :mod:`.index` — which modules the checkpoint fills, and the shards each must receive.
    * :mod:`.modelwise` — the vLLM-facing load routing into staging.
    * :mod:`.processing` — post-load processing of a complete module, copied into live storage.
    * :mod:`.sources`, :mod:`.sparse` — reading checkpoints and sparse patches.
    * :mod:`.sparse_plan` — where a sparse patch lands on this rank, planned before any write.
    * :mod:`.session_record` — what one open update keeps on a rank; its progress and report.
    * :mod:`.prefetch`, :mod:`.shadow` — reading an update into host staging while the rank
      serves, and preparing it on shadow modules.
    * :mod:`.rank_prefetch` — the prefetch half of :class:`RankEngine` (start, poll, apply).
    * :mod:`.engine` — :class:`RankEngine`, one rank's begin/load/finish/abort/state.
    * :mod:`.registry` — the one :class:`RankEngine` per model in the process, shared by the
      worker extension's RPCs and the weight-transfer backends.

Limitations:
    1. Models with a model-level post-load hook are refused (no per-module replay exists).
    2. Derived state is refreshed only for layer types with a registered refresher; other
       owners of derived state fail closed when their sources are updated.
    3. Sparse patches are applied only where the live layout is the checkpoint layout; their
       checkpoint-coordinate indices are mapped through each parameter's shard layout.
    4. Content digests hash checkpoint-layout bytes after the loaders ran (rank-local
       slices); on accelerators this copies each module to host memory once.
"""

from typing import Any

__all__ = ["RankEngine"]


def __getattr__(name: str) -> Any:
    # Lazy: the pure submodules (session, coverage, identity) must import without torch.
    if name == "RankEngine":
        from engine_agent.reload.engine import RankEngine

        return RankEngine
    raise AttributeError(name)
