"""One copy, not two: a prefetch's staging adopts the read buffer a loader copies whole (issue 30).

A prefetched tensor is read once from its file into a private host buffer (:mod:`.owned_reads`),
hashed there, and handed to the model's own ``load_weights``; the parameter's ``weight_loader``
then copied it into the module's staging tensor (:mod:`.modelwise`). Where that copy is a plain
``copy_`` of the whole buffer into the whole staging tensor (same shape, dtype and layout: the
unsharded linears, embeddings and norms of a TP=1 rank, about 60 % of a dense Llama's bytes),
the staging tensor takes the buffer's storage instead (``staging.data = buffer``): the same
bytes in the same slot, one pass over memory fewer. Any other write (a slice, a narrowed view,
another dtype or layout, a part of a fused parameter) is run as the loader asks.

Why this cannot change what is loaded or verified:

* the buffer is the rank's own (read with ``readinto``, never a view of a file), covers its
  whole storage, and is adopted by one staging tensor at most;
* the hash worker reads the buffer, never writes it; a later write into the adopted staging
  (a loader that pads after copying, a post-load step that rewrites in place) is a write the
  loader or step meant for the staging tensor, and lands there. If it lands before the worker
  hashed the buffer, the hash differs from the manifest and the prefetch fails (closed);
* a second consumer of the same buffer (a model handing one checkpoint tensor to two loaders)
  would read what the first one's processing may have rewritten: the router asks
  :meth:`Adoptions.reading` before every loader call, which gives the first staging tensor a
  private copy back while its module is unprocessed and refuses the prefetch after.

Only the prefetch's router adopts (:attr:`~.processing.ModuleProcessor.adopts_reads`); a load
inside the drain copies as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from engine_agent.errors import LoaderUnsupported
from engine_agent.reload.direct import _name

__all__ = ["Adoptions"]


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage().data_ptr())


class Adoptions:
    """The read buffers adopted by one router's staging tensors.

    Args:
        processed: whether a module was processed already (its post-load step ran).
    """

    def __init__(self, processed: Callable[[str], bool]) -> None:
        self._processed = processed
        #: storage address -> (module, parameter, the staging tensor that adopted it).
        self._adopted: dict[int, tuple[str, str, torch.Tensor]] = {}
        #: storage address -> loader calls handed it so far (a buffer read twice is not adopted).
        self._reads: dict[int, int] = {}
        #: bytes not copied because their staging adopted the buffer.
        self.bytes_adopted = 0

    def reading(self, loaded: Any) -> None:
        """A loader is about to read ``loaded``: if a staging tensor adopted its storage, give
        it back a private copy first (its module unprocessed), else refuse.

        Raises:
            LoaderUnsupported: the adopting module was processed already, so the buffer may
                hold what its post-load step wrote.
        """
        if not isinstance(loaded, torch.Tensor) or loaded.device.type != "cpu":
            return
        storage = _storage(loaded)
        adopted = self._adopted.pop(storage, None)
        if adopted is not None:
            module, pname, staging = adopted
            if self._processed(module):
                raise LoaderUnsupported(
                    f"{module}.{pname}: the model hands the checkpoint tensor it was loaded "
                    "from to a second loader after its module was processed; prefetch this "
                    "model without adopting its reads (report the architecture)",
                    field=f"{module}.{pname}",
                )
            staging.data = staging.data.clone()
            self.bytes_adopted -= staging.numel() * staging.element_size()
        self._reads[storage] = self._reads.get(storage, 0) + 1

    @contextmanager
    def during(self, module: str, pname: str, staging: torch.Tensor) -> Iterator[None]:
        """Run one loader call writing ``staging``: a whole copy of a buffer adopts it."""
        with _AdoptWholeCopy(self, module, pname, staging):
            yield

    def adopt(self, module: str, pname: str, staging: torch.Tensor, source: Any) -> bool:
        """Adopt ``source`` as ``staging``'s storage if the copy is whole and plain (module doc)."""
        if not (
            isinstance(source, torch.Tensor)
            and type(source) is torch.Tensor
            and source.device.type == "cpu"
            and staging.device.type == "cpu"
            and source.dtype == staging.dtype
            and tuple(source.shape) == tuple(staging.shape)
            and source.is_contiguous()
            and staging.is_contiguous()
            and not source.requires_grad
            and source.storage_offset() == 0
            and source.untyped_storage().nbytes() == source.numel() * source.element_size()
        ):
            return False
        storage = _storage(source)
        if storage in self._adopted or self._reads.get(storage) != 1:
            return False  # read by another loader already, or adopted by another staging tensor
        staging.data = source
        self._adopted[storage] = (module, pname, staging)
        self.bytes_adopted += source.numel() * source.element_size()
        return True

    def clear(self) -> None:
        self._adopted.clear()
        self._reads.clear()


class _AdoptWholeCopy(TorchFunctionMode):
    """Inside one loader call: ``copy_`` of a whole buffer into the whole ``staging`` adopts."""

    def __init__(self, owner: Adoptions, module: str, pname: str, staging: torch.Tensor) -> None:
        super().__init__()
        self._owner, self._module, self._pname, self._staging = owner, module, pname, staging
        self._adopted = False  # at most one adoption per call; a later whole copy is a write

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (
            not self._adopted
            and _name(func) == "copy_"
            and len(args) == 2
            and not kwargs
            and self._whole(args[0])
            and self._owner.adopt(self._module, self._pname, self._staging, args[1])
        ):
            self._adopted = True
            return args[0]
        return func(*args, **kwargs)

    def _whole(self, target: Any) -> bool:
        """``target`` is the staging tensor or its ``.data``: the same bytes, whole."""
        staging = self._staging
        return (
            isinstance(target, torch.Tensor)
            and target.data_ptr() == staging.data_ptr()
            and target.dtype == staging.dtype
            and tuple(target.shape) == tuple(staging.shape)
            and target.stride() == staging.stride()
            and target.storage_offset() == staging.storage_offset()
        )
