"""Applying a delta in place: the checksum moved by the changed words equals the checksum of the new
bytes, for every item size, on the torch and the numpy path; routes follow the plan's copies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine runs GPU tests without it
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.checksum import tensor_checksum
from weight_sync.reload.delta_checksum import MASK32 as _MASK32
from weight_sync.reload.delta_checksum import checksum_change, checksum_changes
from weight_sync.reload.delta_checksum import checksum_change_np as _checksum_change_np

# Every test here runs with the native CPU kernels and with their numpy twins (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_delta_kernels")
DTYPES = [torch.bool, torch.uint8, torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32,
          torch.int64]


def _int_view(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def _moved(value: int, nbytes: int, change: torch.Tensor) -> int:
    d_plain, d_weighted = (int(x) for x in change.tolist())
    halves = value ^ nbytes
    hi = ((halves >> 32) + d_plain) & _MASK32
    lo = ((halves & _MASK32) + d_weighted) & _MASK32
    return ((hi << 32) | lo) ^ nbytes


@settings(max_examples=30, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), sizes=st.lists(st.integers(0, 500), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_the_checksum_moves_of_a_buckets_writes_computed_together_equal_each_writes_own(
    itemsize: int, sizes: list[int], seed: int
) -> None:
    # CUDA engines move the checksums of a bucket's direct writes in one set of launches.
    g = torch.Generator().manual_seed(seed)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
    info = torch.iinfo(ints)
    writes = []
    for n in sizes:
        byte_pos = torch.randperm(4096, generator=g)[:n].sort().values * itemsize
        old, new = (torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(ints) for _ in range(2))
        writes.append((byte_pos, old, new))
    rows = checksum_changes(writes, itemsize)
    assert rows.shape == (len(writes), 2)
    for row, (byte_pos, old, new) in zip(rows, writes):
        assert torch.equal(row, torch.from_numpy(_checksum_change_np(byte_pos.numpy(), old.numpy(), new.numpy(), itemsize)))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), numel=st.integers(1, 200_000), num_changed=st.integers(0, 3000),
       seed=st.integers(0, 2**16), numpy_path=st.booleans())
def test_moving_a_checksum_by_the_changed_words_gives_the_checksum_of_the_new_bytes(
    dtype: torch.dtype, numel: int, num_changed: int, seed: int, numpy_path: bool
) -> None:
    g = torch.Generator().manual_seed(seed)
    old = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        old = old % 2
    old = old.view(dtype)
    new = old.clone()
    pos = torch.randperm(numel, generator=g)[: min(num_changed, numel)].sort().values
    fresh = torch.randint(0, 256, (pos.numel() * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        fresh = fresh % 2
    _int_view(new)[pos] = _int_view(fresh.view(dtype))
    o, n = _int_view(old)[pos], _int_view(new)[pos]
    byte_pos = pos * dtype.itemsize
    if numpy_path:
        change = torch.from_numpy(_checksum_change_np(byte_pos.numpy(), o.numpy(), n.numpy(), dtype.itemsize))
    else:
        change = checksum_change(byte_pos, o, n, dtype.itemsize)
    nbytes = numel * dtype.itemsize
    assert _moved(tensor_checksum(old), nbytes, change) == tensor_checksum(new)
