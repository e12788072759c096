"""Grouped scattered writes (a delta's changed values into many tensors, one launch): every element
written, the overwritten values kept in order, each tensor's checksum move equal to the per-write
formula; off CUDA the caller is told to write tensor by tensor."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from weight_sync.reload.delta_checksum import checksum_changes
from weight_sync.reload.scatter_many import ScatterWrite, grouped_scatter_available, scatter_many

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def make_writes(itemsize: int, device: str, seed: int = 0) -> list[ScatterWrite]:
    """Writes of every shape a bucket holds: tiny, several programs long, one element, none at all."""
    g = torch.Generator().manual_seed(seed)
    dt = _INT[itemsize]
    writes = []
    for numel, offset, count in ((5, 0, 2), (20_000, 3, 2_857), (3, 1, 1), (9_000, 7, 8_993), (64, 0, 0)):
        dst = torch.randint(-100, 100, (numel,), generator=g).to(dt)
        pos = torch.randperm(numel - offset, generator=g)[:count].sort().values
        vals = torch.randint(-100, 100, (count,), generator=g).to(dt)
        writes.append(ScatterWrite(dst.to(device), offset, pos.to(device), vals.to(device)))
    return writes


def expected(writes: list[ScatterWrite], itemsize: int, slots: list[int], num_slots: int
             ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(destinations after the writes, old values in order, checksum moves per slot) the slow way."""
    after, olds = [], []
    for w in writes:
        d = w.dst.cpu().clone()
        olds.append(d[w.offset + w.pos.cpu()].clone())
        d[w.offset + w.pos.cpu()] = w.vals.cpu()
        after.append(d)
    rows = checksum_changes([((w.pos.cpu() + w.offset) * itemsize, o, w.vals.cpu()) for w, o in zip(writes, olds)],
                            itemsize)
    sums = torch.zeros(num_slots, 2, dtype=torch.int64)
    for s, r in zip(slots, rows):
        sums[s] += r
    return after, torch.cat(olds), sums


def check_grouped(device: str, interpret: bool) -> None:
    for itemsize in (1, 2, 4):
        writes = make_writes(itemsize, device, seed=itemsize)
        slots = [2, 0, 2, 1, 0]
        want_after, want_old, want_sums = expected(writes, itemsize, slots, 3)
        old = torch.empty(want_old.numel(), dtype=_INT[itemsize], device=device)
        sums = torch.zeros(3, 2, dtype=torch.int64, device=device)
        assert scatter_many(writes, itemsize, old=old, sums=sums, slots=slots, interpret=interpret)
        assert all(torch.equal(w.dst.cpu(), a) for w, a in zip(writes, want_after))
        assert torch.equal(old.cpu(), want_old)
        assert torch.equal(sums.cpu(), want_sums)
        # Without old values: the writes alone.
        again = make_writes(itemsize, device, seed=itemsize)
        assert scatter_many(again, itemsize, interpret=interpret)
        assert all(torch.equal(w.dst.cpu(), a) for w, a in zip(again, want_after))


def test_off_cuda_scatter_many_declines_and_writes_nothing() -> None:
    writes = make_writes(2, "cpu")
    before = [w.dst.clone() for w in writes]
    assert not grouped_scatter_available(torch.device("cpu"))
    assert scatter_many(writes, 2) is False
    assert all(torch.equal(w.dst, b) for w, b in zip(writes, before))


def test_scatter_many_refuses_old_values_without_slots_and_a_short_old_buffer() -> None:
    writes = make_writes(2, "cpu")
    with pytest.raises(ValueError, match="one slot per write"):
        scatter_many(writes, 2, old=torch.empty(0, dtype=torch.int16), interpret=True)
    with pytest.raises(ValueError, match="must hold"):
        scatter_many(writes, 2, old=torch.empty(3, dtype=torch.int16), sums=torch.zeros(3, 2, dtype=torch.int64),
                     slots=[0] * len(writes), interpret=True)


_CHILD = r"""
import os
assert os.environ.get("TRITON_INTERPRET") == "1"
from tests.reload.test_scatter_many import check_grouped
check_grouped("cpu", interpret=True)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_grouped_kernel_under_the_interpreter_writes_keeps_and_moves_checksums_like_the_formula() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.gpu
def test_scatter_many_on_cuda_writes_keeps_and_moves_checksums_like_the_formula() -> None:
    check_grouped("cuda", interpret=False)
    torch.cuda.synchronize()
