"""Prefetch: one rank reads and verifies an update's checkpoint into host staging while the
replica still serves (issue 30).

The read runs on a thread of its own, so the engine keeps stepping: it touches no module, no
parameter and no kernel of the model, only the checkpoint files (each tensor read once into a
private host buffer, :mod:`.sources`) and the hash workers, and it waits for every hash before it
reports ``ready`` — a checkpoint whose bytes do not match its manifest is refused before the
drain. Everything that needs the model but no live byte (names, shapes, dtypes, shard keys,
duplicates, per-shard coverage) is checked by the caller's dry run before the thread starts.

What the drain then does with the buffers is the engine's business (``RankEngine.apply``): the
model's own ``load_weights`` routes them into per-module staging, modules are processed and
copied into live storage, exactly as a ``load`` does, minus the read and the hashing.

Memory: every tensor this rank reads (the whole checkpoint for a TP rank: each rank is handed
every tensor, and keeps what it owns only after routing) stays in host memory from the read to
the apply. :func:`memory_problem` refuses a prefetch that would exceed its limit or the host's
available memory before the first byte is read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import torch

from engine_agent.errors import AgentError
from engine_agent.protocol import UpdateSpec

__all__ = ["MEMINFO", "Prefetch", "available_memory", "memory_problem"]

logger = logging.getLogger(__name__)

MEMINFO: Final = Path("/proc/meminfo")


def available_memory(meminfo: Path = MEMINFO) -> int | None:
    """The host's available memory in bytes (``MemAvailable``); ``None`` where unknown."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1)
    return None


def memory_problem(
    stage_bytes: int, max_bytes: int | None, available: int | None, ranks_on_host: int = 1
) -> str | None:
    """Why staging ``stage_bytes`` on this rank is refused, in one line (``None``: it is not).

    ``max_bytes`` is the update's limit per rank; ``available`` the host's available memory
    (``None``: unknown, which refuses: a prefetch that cannot be bounded is not started).
    ``ranks_on_host`` ranks of the replica share this host and prefetch at the same time, each
    reading the same checkpoint, so the host must hold that many times ``stage_bytes``: each
    rank checking only its own share against the same ``MemAvailable`` would let eight TP ranks
    promise the host eight times what it has.
    """
    if max_bytes is not None and stage_bytes > max_bytes:
        return (
            f"prefetch would stage {stage_bytes} bytes on this rank, above its limit "
            f"prefetch.maxBytes={max_bytes}"
        )
    if available is None:
        return (
            f"prefetch would stage {stage_bytes} bytes on this rank, but the host's available "
            "memory is unknown (no MemAvailable in /proc/meminfo)"
        )
    host_bytes = stage_bytes * max(ranks_on_host, 1)
    if host_bytes > available:
        each = (
            f" ({ranks_on_host} ranks on this host, {host_bytes} bytes)"
            if ranks_on_host > 1
            else ""
        )
        return (
            f"prefetch would stage {stage_bytes} bytes on this rank{each}, above the host's "
            f"available memory ({available} bytes)"
        )
    return None


class Prefetch:
    """One rank's read of one update's checkpoint into host buffers (module doc).

    Args:
        spec: the update the staging belongs to.
        checkpoint: the opened source (:func:`engine_agent.reload.sources.open_source`); its
            headers were checked, nothing was read yet.
        stage_bytes: what the read will hold in host memory.
        failpoint: called with ``prefetch.read`` on the reading thread before the first byte.
    """

    def __init__(
        self,
        spec: UpdateSpec,
        checkpoint: Any,
        stage_bytes: int,
        failpoint: Callable[[str], None] = lambda _point: None,
    ) -> None:
        self.spec = spec
        self.checkpoint = checkpoint
        self.stage_bytes = stage_bytes
        self.timings: dict[str, float] = {}
        self.error: AgentError | None = None
        #: The read routed into staging and processed on shadow modules (engine's ``_prepare``,
        #: on the engine's thread once the read is ready); what the drain installs.
        self.prepared: Any = None
        #: The preparation under way: a session whose router has routed what was taken so far
        #: (engine's ``_prepare``), while the read goes on.
        self.preparing: Any = None
        self._failpoint = failpoint
        self._tensors: deque[tuple[str, torch.Tensor]] = deque()
        #: Bytes read and not taken yet (:meth:`take`), under ``_lock`` (two threads count).
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._read, name=f"weightroll-prefetch-{spec.update_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    @property
    def status(self) -> str:
        """``reading`` until the read ended, then ``ready`` (or ``failed``, see :attr:`error`)."""
        if not self._done.is_set():
            return "reading"
        return "failed" if self.error is not None else "ready"

    def cancel(self) -> None:
        """Stop reading at the next tensor and free the buffers (nothing else to undo)."""
        self._cancelled.set()
        self._tensors.clear()
        if self.prepared is not None:
            self.prepared.processor.discard()
            self.prepared = None
        if self.preparing is not None:
            self.preparing.router.discard()
            self.preparing = None

    @property
    def pending_bytes(self) -> int:
        """Bytes read and not taken yet."""
        with self._lock:
            return self._pending_bytes

    def take(self, max_bytes: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """The tensors read so far and not taken yet, in checkpoint order, each handed out once
        (at least one, then as many as fit in ``max_bytes``).

        Their hashes may still be pending: the preparation routes them into private staging and
        shadows while the read goes on, and nothing of it reaches live storage before the read
        is ``ready`` (every hash verified); a mismatch fails the prefetch and drops it all.
        """
        taken: list[tuple[str, torch.Tensor]] = []
        size = 0
        while self._tensors and (max_bytes is None or not taken or size < max_bytes):
            name, tensor = self._tensors.popleft()
            taken.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        with self._lock:
            self._pending_bytes -= size
        return taken

    def consume(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Hand out the staged tensors once, in checkpoint order, each freed once taken."""
        if self.status != "ready":
            raise RuntimeError(f"prefetch of {self.spec.update_id} is {self.status}")
        while self._tensors:
            yield self._tensors.popleft()

    def _read(self) -> None:
        started = time.perf_counter()
        try:
            self._failpoint("prefetch.read")
            for name, tensor in self.checkpoint.tensors():
                if self._cancelled.is_set():
                    return
                self._tensors.append((name, tensor))
                with self._lock:
                    self._pending_bytes += tensor.numel() * tensor.element_size()
            # Waits for every hash: a byte the manifest does not pin fails the prefetch here
            # (the wait is reported as ``prefetch_hash_wait`` by the engine, from the source).
            self.checkpoint.complete()
            self.timings["prefetch_read"] = round(time.perf_counter() - started, 6)
        except AgentError as e:
            self.error = e
        except Exception as e:  # a bug in the read must fail the prefetch, not hang it
            logger.exception("Prefetch of %s crashed", self.spec.update_id)
            self.error = AgentError(f"{type(e).__name__}: {e}")
        finally:
            if self.error is not None or self._cancelled.is_set():
                self._tensors.clear()
            self._done.set()
