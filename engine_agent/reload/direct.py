"""Loaders that write a parameter themselves instead of calling its ``weight_loader``.

The router (:mod:`engine_agent.reload.modelwise`) runs a model's own ``load_weights`` over
meta proxies of its parameters and accounts every ``weight_loader`` call: the shard keys it
writes, the staging tensor it writes them into. Some loaders bypass the ``weight_loader`` for
some parameters: GPT-OSS copies its experts' fused weights and biases and its attention sinks
with ``param.copy_(...)`` and ``param.data.copy_(...)``. Into a meta proxy such a write is lost
without a trace: nothing is staged, nothing recorded, and the update fails coverage only after
other modules were already written (the replica poisoned, every full update failing).

:class:`DirectWrites` is a torch function mode active for the whole ``load_weights`` call that
watches, outside accounted loader calls, every write into a proxy:

* a ``copy_`` of a whole tensor into a proxy or into its ``.data`` alias, or an assignment to
  its ``.data``, is handed to the router as if the parameter's loader had received that tensor
  whole (:data:`Route`): staged, and every shard key of the parameter recorded;
* any other write into a proxy, its alias or a tensor taken from one (a slice's ``copy_``,
  ``__setitem__``, another in-place op) cannot be accounted shard by shard and is refused
  (:data:`Refuse`), naming the parameter. The dry run meets it first, before anything is
  written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DirectWrites", "Refuse", "Route"]

#: Writes ``tensor`` (what the loader wrote; the router checks it) whole into ``target``.
Route = Callable[[Any, Any], None]
#: Raises the refusal of a write into ``target`` that cannot be accounted (``what`` says how).
Refuse = Callable[[Any, str], None]

#: In-place operator methods whose names do not end in ``_``.
_IN_PLACE_DUNDERS = frozenset(
    {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__"}
    | {"__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"}
)


#: The ``Tensor.data`` property: its getter and setter reach the mode as method wrappers of it.
_DATA = torch._C.TensorBase.__dict__["data"]


def _name(func: Any) -> str:
    if getattr(func, "__self__", None) is _DATA:
        return f"data.{func.__name__}"  # data.__get__ / data.__set__
    return str(getattr(func, "__name__", ""))


def _in_place(name: str) -> bool:
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


class DirectWrites(TorchFunctionMode):
    """Sees every write into a registered proxy outside an accounted loader call (module doc).

    Args:
        route: called for a whole-tensor write into a proxy.
        refuse: called for a write that cannot be accounted; must raise.
    """

    def __init__(self, route: Route, refuse: Refuse) -> None:
        super().__init__()
        self._route = route
        self._refuse = refuse
        #: id -> (target, tensor): the proxies and their ``.data`` aliases (kept alive, so an
        #: id is never reused while registered).
        self._whole: dict[int, tuple[Any, torch.Tensor]] = {}
        #: id -> (target, tensor): tensors taken from a proxy (views, slices, results).
        self._taken: dict[int, tuple[Any, torch.Tensor]] = {}
        self._accounted = 0

    def register(self, proxy: torch.Tensor, target: Any) -> None:
        """Watch writes into ``proxy``; ``target`` is what :data:`Route` and :data:`Refuse`
        are told."""
        self._whole[id(proxy)] = (target, proxy)

    @contextmanager
    def accounted(self) -> Iterator[None]:
        """A loader call the router accounts itself: its writes are not direct."""
        self._accounted += 1
        try:
            yield
        finally:
            self._accounted -= 1

    def _target(self, tensor: Any) -> tuple[Any, bool] | None:
        """``(target, whole)`` of a watched tensor, else None."""
        if not isinstance(tensor, torch.Tensor):
            return None
        if id(tensor) in self._whole:
            return self._whole[id(tensor)][0], True
        if id(tensor) in self._taken:
            return self._taken[id(tensor)][0], False
        return None

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        watched = self._target(args[0]) if args and not self._accounted else None
        if watched is None:
            return func(*args, **kwargs)
        target, whole = watched
        name = _name(func)
        if name == "data.__set__" and whole and len(args) > 1:  # param.data = tensor
            self._route(target, args[1])
            return None
        if name == "copy_" and whole:
            source = args[1] if len(args) > 1 else kwargs.get("src")
            self._route(target, source)
            return args[0]
        if _in_place(name) or name.endswith("__set__"):
            how = "part of it" if not whole else f"it in place with {name}"
            self._refuse(target, f"the model's loader writes {how}, not through its weight loader")
        result = func(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            # ``param.data`` is the parameter; anything else taken from it is a part of it.
            table = self._whole if name == "data.__get__" and whole else self._taken
            table[id(result)] = (target, result)
        return result
