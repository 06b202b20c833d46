"""Content hashes of checkpoint bytes and tensors, and a pool that computes them off the loaders.

Three tools, one per question:

* :func:`content_hash` (from :mod:`engine_agent.manifest`, which the torch-free sidecar shares) —
  "are these the bytes the manifest pins?": BLAKE3 (``weightroll.manifest/v2``) or SHA-256
  (``weightroll.manifest/v1``, still accepted) over a C-contiguous host buffer.
* :class:`VerifyPool` — the same check *while* the loaders run: every tensor the source yields is
  handed to a worker thread (``hashlib`` and ``blake3`` release the GIL), so hashing overlaps the
  model's weight loaders and post-load processing; a mismatch is raised at the next tensor the
  loaders ask for, or at the end of the batch at the latest. The hash covers the very tensor
  object the loaders consume, which must be memory the caller owns: the hash may run after the
  loaders copied the tensor (up to :data:`MAX_PENDING_BYTES` behind), so a view of a file (an
  mmap that an in-place rewrite changes underneath) would be hashed with other bytes than were
  loaded. :mod:`.sources` reads each checkpoint tensor once into a private buffer for this.
* :func:`fingerprint` — "which bytes does this tensor hold?", on the tensor's own device with
  torch ops (a GPU never copies weights to host to verify them). Not cryptographic: it guards
  against accidents (a rank that loaded other bytes than its peers), not against an adversary who
  can write the ranks' memory. On CPU tensors :func:`tensor_digest` uses BLAKE3 instead, which is
  faster there and needs no copy.

:func:`load_hashing` applies the pool to pushed tensors (the trainer path): host tensors are
hashed while the loaders consume them, accelerator tensors fingerprinted afterwards.

:func:`rank_digest` (also from :mod:`engine_agent.manifest`) folds per-tensor hashes into one
(sorted ``name:hash;`` list, SHA-256): a rank's ``digest`` (``engine_agent/protocol/``).

This module imports no vLLM; torch is imported lazily by the tensor helpers.

The pool's worker count is ``min(4, cpu count - 1)`` (at least 1), or
``WEIGHTROLL_HASH_THREADS``. Pending work is bounded (:data:`MAX_PENDING_BYTES`): when the
loaders outrun the hashers, :meth:`VerifyPool.submit` waits, so the pool never pins more than
that much of the checkpoint in memory.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

from engine_agent.manifest import HashAlgorithm, content_hash, new_hasher, rank_digest

if TYPE_CHECKING:
    import torch

__all__ = [
    "HashAlgorithm",
    "VerifyPool",
    "content_hash",
    "fingerprint",
    "host_bytes",
    "load_hashing",
    "new_hasher",
    "rank_digest",
    "tensor_digest",
]

#: Bytes handed to the workers and not yet hashed, at most (back-pressure on the reader).
MAX_PENDING_BYTES: Final = 1 << 30
#: Elements per fingerprint row: the column sums see position within a row, the weighted row
#: sums position across rows.
_FINGERPRINT_ROW: Final = 64
#: Odd multipliers (splitmix64 constants) that make the fingerprint position-dependent.
_MUL_A: Final = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL_B: Final = 0xBF58476D1CE4E5B9 - (1 << 64)


def host_bytes(tensor: torch.Tensor) -> Any:
    """The raw bytes of a CPU tensor as a numpy ``uint8`` view (a copy only if not contiguous)."""
    import torch

    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        raise ValueError("host_bytes needs a CPU tensor; use fingerprint() on device tensors")
    return flat.contiguous().view(torch.uint8).numpy()


def fingerprint(tensor: torch.Tensor) -> str:
    """A position-dependent 128-bit fingerprint of a tensor's bytes, computed on its device.

    The bytes are read as little-endian 64-bit words (``uint8`` words for sizes not divisible by
    8) in rows of 64; the fingerprint is the weighted sum of the column sums and the weighted sum
    of the row sums (all arithmetic modulo 2**64, so reduction order and device do not matter:
    the same bytes give the same fingerprint on CPU and GPU). Two torch reductions, no host
    copy of the data; only two scalars cross to the host.
    """
    import torch

    flat = tensor.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    raw = flat.view(torch.uint8)
    if raw.numel() % 8 == 0:
        try:
            words = raw.view(torch.int64)
        except RuntimeError:  # storage offset not 8-byte aligned
            words = raw.clone().view(torch.int64)
    else:
        words = raw.to(torch.int64)
    n = words.numel()
    body = n - n % _FINGERPRINT_ROW
    rows = words[:body].view(-1, _FINGERPRINT_ROW)
    device = words.device
    col_weights = torch.arange(1, _FINGERPRINT_ROW + 1, device=device, dtype=torch.int64) * _MUL_A
    columns = (rows.sum(0) * col_weights).sum() if body else torch.zeros((), dtype=torch.int64)
    row_sums = rows.sum(1)
    row_weights = torch.arange(1, row_sums.numel() + 1, device=device, dtype=torch.int64) * _MUL_B
    across = (row_sums * row_weights).sum() if body else torch.zeros((), dtype=torch.int64)
    tail = words[body:]
    tail_weights = torch.arange(1, tail.numel() + 1, device=device, dtype=torch.int64) * _MUL_B
    across = across + (tail * tail_weights).sum()
    high, low = (int(v) & 0xFFFFFFFFFFFFFFFF for v in (columns, across))
    return f"fp1:{n:x}:{high:016x}{low:016x}"


def tensor_digest(tensor: torch.Tensor) -> str:
    """Digest of a tensor's bytes where they live: BLAKE3 on the host, :func:`fingerprint` else."""
    if tensor.device.type == "cpu":
        return "blake3:" + content_hash(host_bytes(tensor), "blake3")
    return fingerprint(tensor)


def _workers() -> int:
    configured = os.environ.get("WEIGHTROLL_HASH_THREADS")
    if configured:
        return max(1, int(configured))
    # Leave one core to the loaders (vLLM's CPU worker runs torch on one thread per rank).
    return max(1, min(4, (os.cpu_count() or 1) - 1))


class VerifyPool:
    """Hash tensors in worker threads while the caller keeps loading.

    ``submit(name, tensor, check)`` hashes ``tensor``'s host bytes in a worker and calls
    ``check(name, hex)``, which raises on a mismatch. :meth:`raise_first` re-raises the first
    failure among the checks that have finished (call it before handing out the next tensor);
    :meth:`drain` waits for all of them and re-raises the first failure. The pool holds a
    reference to each tensor until it is hashed, so the bytes hashed are the bytes handed out
    provided nothing else can change them: submit buffers the caller owns (never a view of a
    file or of memory another writer reaches), and do not write to them before :meth:`drain`.
    """

    def __init__(self, algorithm: HashAlgorithm, workers: int | None = None) -> None:
        self.algorithm = algorithm
        self._executor = ThreadPoolExecutor(
            max_workers=workers or _workers(), thread_name_prefix="weightroll-hash"
        )
        self._pending: list[tuple[Future[None], int]] = []
        self._lock = threading.Lock()
        self.bytes_hashed = 0
        #: Seconds the workers spent hashing (summed over workers; overlaps the caller).
        self.hash_seconds = 0.0
        #: Seconds the caller waited for workers in :meth:`drain`.
        self.wait_seconds = 0.0

    def submit(self, name: str, tensor: torch.Tensor, check: Callable[[str, str], None]) -> None:
        data = host_bytes(tensor)
        size = int(data.nbytes)
        self.bytes_hashed += size
        self._backpressure(size)

        def work() -> None:
            started = time.perf_counter()
            digest = content_hash(data, self.algorithm)
            with self._lock:
                self.hash_seconds += time.perf_counter() - started
            check(name, digest)

        self._pending.append((self._executor.submit(work), size))

    def _backpressure(self, incoming: int) -> None:
        pending = sum(size for future, size in self._pending if not future.done())
        started = time.perf_counter()
        while self._pending and pending + incoming > MAX_PENDING_BYTES:
            future, size = self._pending[0]
            future.result()
            self._pending.pop(0)
            pending -= size
        self.wait_seconds += time.perf_counter() - started

    def raise_first(self) -> None:
        """Re-raise the first failure among the checks already done (never blocks)."""
        for future, _ in self._pending:
            if future.done():
                future.result()
        self._pending = [(f, n) for f, n in self._pending if not f.done()]

    def drain(self) -> None:
        """Wait for every check; re-raise the first failure (the others are dropped)."""
        started = time.perf_counter()
        try:
            for future, _ in self._pending:
                future.result()
        finally:
            self.wait_seconds += time.perf_counter() - started
            self._pending = []

    def close(self) -> None:
        for future, _ in self._pending:
            future.cancel()
        self._executor.shutdown(wait=True)
        self._pending = []


def load_hashing(
    weights: Sequence[tuple[str, torch.Tensor]],
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
    timings: dict[str, float],
) -> dict[str, str]:
    """Hand ``weights`` to ``load`` and return each one's content hash (name -> digest).

    Pushed tensors enter the rank digest like checkpoint tensors do (their content hash). Host
    tensors are hashed by worker threads while the loaders consume them, as file loads are
    (BLAKE3 releases the GIL); a tensor on an accelerator is fingerprinted on its own device,
    in this thread, after ``load`` (its stream order is the loaders'). The seconds spent are
    added to ``timings`` under ``load``, ``hash_wait`` and ``hash_overlapped``.
    """
    hashes: dict[str, str] = {}
    pool = VerifyPool("blake3")

    def record(name: str, digest: str) -> None:
        hashes[name] = "blake3:" + digest

    def handed_out() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if tensor.device.type == "cpu":
                pool.submit(name, tensor, record)
            yield name, tensor

    try:
        started = time.perf_counter()
        try:
            load(handed_out())
        finally:
            _add_seconds(timings, "load", time.perf_counter() - started)
        started = time.perf_counter()
        try:
            pool.drain()
            for name, tensor in weights:
                if tensor.device.type != "cpu":
                    hashes[name] = tensor_digest(tensor)
        finally:
            _add_seconds(timings, "hash_wait", time.perf_counter() - started)
    finally:
        pool.close()
    _add_seconds(timings, "hash_overlapped", pool.hash_seconds)
    return hashes


def _add_seconds(timings: dict[str, float], step: str, seconds: float) -> None:
    timings[step] = round(timings.get(step, 0.0) + seconds, 6)
