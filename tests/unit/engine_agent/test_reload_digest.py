"""Unit tests of ``engine_agent.reload.digest``: the device fingerprint and the verify pool."""

from __future__ import annotations

import threading

import pytest
import torch

from engine_agent.manifest import content_hash, rank_digest
from engine_agent.reload.digest import VerifyPool, fingerprint, host_bytes, tensor_digest


def test_fingerprint_is_a_function_of_the_bytes() -> None:
    torch.manual_seed(0)
    t = torch.randn(64, 33, dtype=torch.bfloat16)
    assert fingerprint(t) == fingerprint(t.clone())
    # The same bytes under another dtype or shape: same fingerprint (it reads bytes).
    assert fingerprint(t) == fingerprint(t.view(torch.int16).reshape(-1))
    # A non-contiguous view is fingerprinted by its values, like a contiguous copy.
    assert fingerprint(t.t()) == fingerprint(t.t().contiguous())


@pytest.mark.parametrize("numel", [1, 7, 64, 1000, 4096 + 3])
def test_fingerprint_sees_every_byte_and_its_position(numel: int) -> None:
    torch.manual_seed(1)
    t = torch.randint(0, 255, (numel,), dtype=torch.uint8)
    base = fingerprint(t)
    for index in {0, numel // 2, numel - 1}:
        flipped = t.clone()
        flipped[index] ^= 1
        assert fingerprint(flipped) != base, index
    if numel > 1:
        swapped = t.clone()
        swapped[0], swapped[-1] = int(t[-1]) + 0, int(t[0]) + 0
        if not torch.equal(swapped, t):
            assert fingerprint(swapped) != base


def test_fingerprint_sees_swapped_rows_of_a_matrix() -> None:
    torch.manual_seed(2)
    t = torch.randn(128, 64, dtype=torch.float32)
    swapped = t[[1, 0, *range(2, 128)]]
    assert fingerprint(swapped) != fingerprint(t)


def test_tensor_digest_on_cpu_is_blake3_of_the_bytes() -> None:
    t = torch.arange(10, dtype=torch.float32)
    assert tensor_digest(t) == "blake3:" + content_hash(host_bytes(t), "blake3")


def test_the_pool_checks_every_tensor_and_reraises_the_first_mismatch() -> None:
    tensors = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}
    expected = {n: content_hash(host_bytes(t), "blake3") for n, t in tensors.items()}
    seen: dict[str, str] = {}
    lock = threading.Lock()

    def check(name: str, digest: str) -> None:
        if digest != expected[name] or name == "t5":
            raise ValueError(f"mismatch {name}")
        with lock:
            seen[name] = digest

    pool = VerifyPool("blake3", workers=2)
    try:
        for name, tensor in tensors.items():
            pool.submit(name, tensor, check)
        with pytest.raises(ValueError, match="mismatch t5"):
            pool.drain()
    finally:
        pool.close()
    assert pool.bytes_hashed == 8 * 4000
    assert set(seen) == set(tensors) - {"t5"}
    assert rank_digest(seen) != rank_digest(expected)
