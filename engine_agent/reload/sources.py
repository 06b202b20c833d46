"""Reading checkpoint tensors for one rank: safetensors files or directories, into owned memory.

Sources are read the way vLLM's own loader reads them, so an update loads what a cold start
would: a directory with ``model.safetensors.index.json`` is exactly the files and tensor names
its ``weight_map`` lists (stale shards beside them are ignored; a listed file that lacks a listed
name, or holds a name the index puts elsewhere, is refused); without an index, every
``*.safetensors`` file. A tensor name found in two files is refused, naming both.

Every problem with the source is raised as an :mod:`engine_agent.errors` error naming the file
or tensor, before any byte reaches the model: missing path, not safetensors, truncated file,
unknown requested names, and (when a manifest is given) a tensor the manifest does not list, or
whose file, dtype, shape or size differ. The manifest's content hashes are checked on the very
tensors the loaders consume, while they consume them (:class:`~engine_agent.reload.digest.
VerifyPool`): a mismatch raises :class:`ManifestMismatch` from the iterator at the next tensor or
at its end, so the ``load`` fails — and a rank that already wrote live bytes is poisoned by the
session state machine. Before the session's first live write the engine waits for every hash
handed out so far (:meth:`CheckpointSource.verified_so_far`), so a checkpoint that is wrong from
its first tensor leaves the rank clean.

**One read, into memory the rank owns** (issue 26, item 2). Each tensor is read once from the
file into a private host buffer (``torch.empty`` + ``readinto``); that buffer is what the pool
hashes and what the loaders (or the sparse path, after verification) consume. It is never a view
of the file: a safetensors tensor is an mmap of the page cache, so a file rewritten in place
(``rsync --inplace``) between the loaders' copy and the worker's hash would commit bytes the
manifest does not pin under a matching hash. The cost is one copy per tensor (page cache ->
buffer), done by a reader thread up to :data:`~.owned_reads.READ_AHEAD_BYTES` ahead of the
loaders, and at most :data:`~engine_agent.reload.digest.MAX_PENDING_BYTES` of buffers waiting
for the hashers (the reads themselves: :mod:`.owned_reads`).
The file's header is re-read when the file is opened for the bytes; a tensor whose dtype or
shape changed since :func:`open_source` is refused.

Every tensor handed out is hashed (BLAKE3, or the manifest's algorithm), verified or not; the
hashes are :attr:`CheckpointSource.content_hashes`, the input of the rank's digest.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from engine_agent.errors import ManifestMismatch, SourceUnavailable, UnknownTensor
from engine_agent.protocol import LoadSource, UpdateMode, UpdateSpec
from engine_agent.reload.owned_reads import (
    TensorInfo,
    byte_ranges,
    placed_now,
    read_ahead,
    safetensors_dtype,
    torch_dtype,
)

__all__ = ["CheckpointSource", "open_checkpoint", "open_source"]


class CheckpointSource:
    """The tensors one ``weightroll_load`` call reads, with their headers already validated.

    Args:
        files: the files to read, in order.
        infos: name -> header facts of every tensor to hand out.
        metadata: the files' safetensors metadata, merged.
        manifest: a ``Manifest`` whose content hashes every tensor must match (headers were
            already checked against it by :func:`open_source`), or ``None``.
    """

    def __init__(
        self,
        files: list[Path],
        infos: dict[str, TensorInfo],
        metadata: dict[str, str],
        manifest: Any = None,
    ):
        self.files = files
        self.infos = infos
        self.metadata = metadata
        self.manifest = manifest
        #: name -> content hash of the bytes handed out (filled as the workers finish).
        self.content_hashes: dict[str, str] = {}
        #: Seconds the workers hashed, and seconds the reader waited for them at the end.
        self.hash_seconds = 0.0
        self.hash_wait_seconds = 0.0
        self._pool: Any = None

    @property
    def algorithm(self) -> str:
        return "blake3" if self.manifest is None else str(self.manifest.algorithm)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` file by file, each tensor read once into a buffer it owns.

        The tensor yielded is the buffer the pool hashes: nothing reads the file again for it,
        so what is verified (and recorded in :attr:`content_hashes`) is what the caller gets,
        whatever happens to the file afterwards.

        Raises:
            ManifestMismatch: (from the iterator) a tensor's bytes differ from the manifest.
            SourceUnavailable: a file cannot be read, is shorter than its header promised, or
                its header changed since :func:`open_source` read it.
        """
        from engine_agent.reload.digest import VerifyPool

        pool = VerifyPool(self.algorithm)  # type: ignore[arg-type]
        self._pool = pool
        try:
            for file in self.files:
                infos = [info for info in self.infos.values() if info.file == file]
                if not infos:
                    continue
                try:
                    # Unbuffered: ``readinto`` then reads straight into the tensor's buffer.
                    handle = file.open("rb", buffering=0)
                except OSError as e:
                    raise SourceUnavailable(f"cannot read {file}: {e}", field="path") from e
                with handle:
                    for info, tensor in read_ahead(handle, placed_now(file, handle, infos)):
                        pool.raise_first()
                        pool.submit(info.name, tensor, self._record)
                        yield info.name, tensor
            pool.drain()
        finally:
            self.hash_seconds += pool.hash_seconds
            self.hash_wait_seconds += pool.wait_seconds
            pool.close()
            self._pool = None

    def verified_so_far(self) -> None:
        """Wait until every tensor handed out so far is hashed and checked (raise on mismatch).

        Called before a session's first live write: a checkpoint that differs from its manifest
        from the first tensor on is then refused while the rank is still clean; a mismatch
        found later (a file re-published mid-load) poisons it.
        """
        if self._pool is not None:
            self._pool.drain()

    def complete(self) -> None:
        """After the loaders returned: every tensor was handed out, hashed and verified.

        Raises:
            ManifestMismatch: a hash that did not match (still pending when the loaders
                returned), or tensors that were never hashed (the loaders stopped early).
        """
        pool = self._pool
        if pool is not None:  # the loaders did not exhaust the iterator
            try:
                pool.drain()
            finally:
                pool.close()
                self._pool = None
        unhashed = sorted(self.infos.keys() - self.content_hashes.keys())
        if unhashed:
            raise ManifestMismatch(
                f"{len(unhashed)} tensor(s) of the source were not read and verified: "
                f"{', '.join(unhashed[:5])}",
                field=unhashed[0],
            )

    def _record(self, name: str, digest: str) -> None:
        if self.manifest is not None:
            from engine_agent.manifest import ManifestError

            try:
                self.manifest.check_hash(name, digest)
            except ManifestError as e:
                raise ManifestMismatch(str(e), field=name) from e
        self.content_hashes[name] = digest

    def verify(self, manifest: Any) -> None:
        """Read every tensor once and check it against ``manifest`` (tests, tools).

        Raises:
            ManifestMismatch: naming the first tensor that differs.
        """
        check_headers(self.infos, manifest)
        self.manifest = manifest
        for _ in self.tensors():
            pass
        self.complete()


def check_headers(infos: dict[str, TensorInfo], manifest: Any) -> None:
    """Check file, dtype, shape and size of every tensor against ``manifest`` (no bytes read).

    Raises:
        ManifestMismatch: naming the first tensor that differs or is not listed.
    """
    from engine_agent.manifest import DTYPE_SIZES, ManifestError

    for name, info in infos.items():
        dtype = safetensors_dtype(info.dtype)
        size = DTYPE_SIZES.get(dtype)
        try:
            manifest.check_header(
                name,
                dtype=dtype,
                shape=list(info.shape),
                nbytes=None if size is None else info.shape.numel() * size,
                file=info.file.name,
            )
        except ManifestError as e:
            raise ManifestMismatch(str(e), field=name) from e


def open_source(
    path: str, names: Sequence[str] | None = None, manifest: Any = None
) -> CheckpointSource:
    """Validate ``path`` (a safetensors file or a directory of them) and read its headers.

    Args:
        path: the source.
        names: optional subset of tensor names to read.
        manifest: optional ``Manifest``: headers are checked now, content hashes while reading.

    Raises:
        SourceUnavailable: the path is missing, empty, not safetensors or truncated, the index
            is unusable or disagrees with the files, or a tensor name is in two files.
        UnknownTensor: a requested name is in none of the files.
        ManifestMismatch: a tensor the manifest does not list, or whose header facts differ.
    """
    from safetensors import safe_open

    from engine_agent.manifest import ManifestError, checkpoint_files, index_conflicts

    root = Path(path)
    try:
        files, weight_map = checkpoint_files(root)
    except ManifestError as e:
        raise SourceUnavailable(str(e), field="path") from e
    infos: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for file in files:
        try:
            size = file.stat().st_size
            ranges = byte_ranges(file, size)
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                metadata |= handle.metadata() or {}
                found: dict[str, TensorInfo] = {}
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    piece = handle.get_slice(name)
                    start, end = ranges[name]
                    found[name] = TensorInfo(
                        name,
                        file,
                        torch.Size(piece.get_shape()),
                        torch_dtype(piece.get_dtype()),
                        start,
                        end - start,
                    )
        except SourceUnavailable:
            raise
        except Exception as e:  # safetensors raises its own error types
            raise SourceUnavailable(
                f"{file} is not a readable safetensors file: {e}", field="path"
            ) from e
        conflicts = index_conflicts(weight_map, file.name, list(found))
        if conflicts:
            raise SourceUnavailable(
                f"{root}: the files disagree with the index: {'; '.join(conflicts[:5])}",
                field="path",
            )
        for name, info in found.items():
            if name in infos:
                raise SourceUnavailable(
                    f"tensor {name!r} appears in both {infos[name].file.name} and {file.name} "
                    f"in {root}; remove the stale file (vLLM would load only one of them)",
                    field=name,
                )
            infos[name] = info
    if names is not None:
        unknown = sorted(set(names) - infos.keys())
        if unknown:
            raise UnknownTensor(
                f"requested tensor(s) not found in {root}: {', '.join(unknown[:8])}", field="names"
            )
        infos = {n: infos[n] for n in names}
    if manifest is not None:
        check_headers(infos, manifest)
    return CheckpointSource(files, infos, metadata, manifest)


def open_checkpoint(source: LoadSource, spec: UpdateSpec) -> CheckpointSource:
    """Read ``source``'s manifest (checked against the pin and ``spec``) and open its files:
    headers are checked against the manifest here; content hashes on the very bytes the
    loaders consume, while they consume them: one read, no window.

    Raises:
        ManifestMismatch: the manifest is unreadable, not the pinned one, or names another
            version (:func:`_check_manifest_versions`).
        SourceUnavailable: as :func:`open_source`.
    """
    manifest = None
    if source.manifest is not None:
        from engine_agent.manifest import ManifestError, load_manifest

        try:
            manifest = load_manifest(source.manifest, pinned=source.manifest_digest)
        except (ManifestError, OSError) as e:
            raise ManifestMismatch(f"manifest {source.manifest}: {e}", field="manifest") from e
        _check_manifest_versions(manifest, spec, source.manifest)
    return open_source(source.path, source.names, manifest)


def _check_manifest_versions(manifest: Any, spec: UpdateSpec, path: str) -> None:
    """Refuse a manifest written for another version (or, for a sparse patch, another base).

    The agent checks this too; the rank checks it again on the manifest it read itself, so a
    caller that skips the agent (or a manifest replaced after the agent read it, when no digest
    pins it) cannot commit bytes under a version their manifest does not name.

    Raises:
        ManifestMismatch: naming both versions.
    """
    if manifest.version is not None and manifest.version != spec.version:
        raise ManifestMismatch(
            f"manifest {path} is for version {manifest.version!r} but this update commits "
            f"{spec.version!r}; nothing was loaded",
            field="manifest",
        )
    if spec.mode is UpdateMode.SPARSE and manifest.base_version != spec.base_version:
        raise ManifestMismatch(
            f"manifest {path} applies to base version {manifest.base_version!r} but this "
            f"update declares baseVersion {spec.base_version!r}; nothing was loaded",
            field="manifest",
        )
