"""A shadow's install proves the live bytes are the shadow's (``reload/shadow.py``).

The commit's seal of a prefetched update records the shadows' digests, taken before the drain,
not a hash of the live bytes: a copy that did not land must fail the install inside the drain,
not be found by the guard a period after the replica went back into traffic.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from engine_agent.errors import IdentityChanged
from engine_agent.reload.processing import ModuleProcessor
from engine_agent.reload.shadow import ShadowModule, _same_bytes


def _pair() -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(0)
    live, shadow = nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=True)
    for t in (live.weight, live.bias):
        t.data.zero_()
    shadow.bias.data[0] = float("nan")  # a NaN is copied as it is and equals itself bit for bit
    return live, shadow


def _install(live: nn.Module, shadow: nn.Module) -> None:
    marks: list[str] = []
    ShadowModule("layer", live, shadow, before=dict(shadow.__dict__)).install(
        lambda: marks.append("dirty"), lambda _point: None
    )
    assert marks == ["dirty"]


def test_the_install_copies_every_tensor_in_place() -> None:
    live, shadow = _pair()
    pointers = (live.weight.data_ptr(), live.bias.data_ptr())
    _install(live, shadow)
    assert (live.weight.data_ptr(), live.bias.data_ptr()) == pointers
    for got, want in ((live.weight, shadow.weight), (live.bias, shadow.bias)):
        assert torch.equal(got.detach().view(torch.uint8), want.detach().view(torch.uint8))


def test_a_copy_that_did_not_land_fails_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    copy = ModuleProcessor._copy_into_live

    def lossy(module: str, live: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> None:
        copy(module, live, new)
        if "weight" in live:
            live["weight"].data.view(-1)[3] += 1.0  # one element the copy got wrong

    monkeypatch.setattr(ModuleProcessor, "_copy_into_live", staticmethod(lossy))
    live, shadow = _pair()
    with pytest.raises(IdentityChanged, match=r"layer\.weight: the live bytes differ"):
        _install(live, shadow)


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float16, torch.float32, torch.int64]),
    numel=st.integers(1, 67),
    offset=st.integers(0, 7),
    flip=st.data(),
)
def test_same_bytes_sees_every_changed_byte_whatever_the_size_and_address(
    dtype: torch.dtype, numel: int, offset: int, flip: st.DataObject
) -> None:
    """The compare reads words as wide as size and address allow: one flipped byte anywhere,
    at any offset into a storage and any length, is still a difference, and equal bytes (NaN
    payloads included) are still equal."""
    base = torch.randint(0, 256, ((numel + offset) * dtype.itemsize,), dtype=torch.uint8)
    a = base.view(dtype)[offset:]
    b = a.clone()
    assert _same_bytes(a, b)
    position = flip.draw(st.integers(0, a.numel() * dtype.itemsize - 1))
    b.view(torch.uint8)[position] ^= 1 << flip.draw(st.integers(0, 7))
    assert not _same_bytes(a, b)
