"""Writes a loader makes into a parameter without its weight loader (engine_agent/reload/direct.py).

GPT-OSS's ``load_weights`` copies its experts' fused weights and biases and its attention sinks
with ``param.copy_`` / ``param.data.copy_``; into the router's meta proxies those writes were
lost, and every full update failed coverage after writing (docs/models.md). Each way a loader can
write into a proxy is one row: a whole write is routed to the accounting, any other is refused.
The real-engine path is GPT-OSS in tests/engine/test_registry_subset.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine_agent.reload.direct import DirectWrites


class Refused(Exception):
    pass


def watch() -> tuple[DirectWrites, torch.Tensor, list[tuple[str, Any]]]:
    proxy = torch.nn.Parameter(torch.empty(4, 3, device="meta"), requires_grad=False)
    seen: list[tuple[str, Any]] = []

    def route(target: str, tensor: Any) -> None:
        seen.append((target, tensor))

    def refuse(target: str, what: str) -> None:
        raise Refused(f"{target}: {what}")

    mode = DirectWrites(route, refuse)
    mode.register(proxy, "layer.sinks")
    return mode, proxy, seen


SOURCE = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def assign_data(p: torch.Tensor) -> None:
    p.data = SOURCE


def set_item(p: torch.Tensor) -> None:
    p[0] = 1.0


@pytest.mark.parametrize(
    ("write", "outcome"),
    [
        (lambda p: p.copy_(SOURCE), "routed"),  # GPT-OSS's experts: param.copy_(...)
        (lambda p: p.data.copy_(SOURCE), "routed"),  # GPT-OSS's sinks: param.data.copy_(...)
        (assign_data, "routed"),  # param.data = tensor
        (lambda p: p[0].copy_(SOURCE[0]), "part of it"),  # one expert of a fused tensor
        (lambda p: p.data[1:].copy_(SOURCE[1:]), "part of it"),
        (lambda p: p.narrow(0, 0, 2).copy_(SOURCE[:2]), "part of it"),
        (lambda p: p.data[0].fill_(0.0), "part of it"),
        (set_item, "in place with __setitem__"),
        (lambda p: p.zero_(), "in place with zero_"),
        (lambda p: p.data.add_(1.0), "in place with add_"),
        (lambda p: (p.shape, p.dtype, p.T.shape), "nothing"),
    ],
)
def test_a_whole_write_is_routed_and_any_other_refused(
    write: Callable[[torch.Tensor], Any], outcome: str
) -> None:
    mode, proxy, seen = watch()
    if outcome == "routed":
        with mode:
            write(proxy)
        assert len(seen) == 1 and seen[0][0] == "layer.sinks"
        assert torch.equal(seen[0][1], SOURCE)
        return
    if outcome == "nothing":
        with mode:
            write(proxy)
        assert seen == []
        return
    with mode, pytest.raises(Refused, match=outcome):
        write(proxy)
    assert seen == []


def test_writes_inside_an_accounted_loader_call_are_the_loaders_own() -> None:
    """The router runs each parameter's weight loader inside ``accounted``: what it writes
    (slices of the proxy in the dry run) is accounted there, never routed or refused here."""
    mode, proxy, seen = watch()
    with mode, mode.accounted():
        proxy.copy_(SOURCE)
        proxy.data[0].copy_(SOURCE[0])
        proxy.zero_()
    assert seen == []


def test_an_unwatched_tensor_is_left_alone() -> None:
    mode, _, seen = watch()
    other = torch.empty(4, 3)
    with mode:
        other.copy_(SOURCE)
        other[0] = 2.0
    assert seen == [] and float(other[0, 0]) == 2.0
