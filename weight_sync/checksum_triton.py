"""The checksum of many tensors in one Triton launch, at memory speed: a model's fingerprint on CUDA.

:mod:`weight_sync.checksum` defines the checksum (two 32-bit sums of the little-endian words, the second
weighted by ``(i % 65521) + 1``) and computes it with torch: a column reduction over rows of 65521 words,
a product with the weight rows and a row sum, three launches per tensor and a reduction that reads far
below the memory bandwidth. Here each program owns one chunk of 65521 words of one tensor (so a word's
weight is its index in the chunk plus one), sums them and their weighted values in int32 with
wrap-around (exactly the sums mod 2**32 the definition keeps) and adds both into the tensor's two
counters with integer atomics (addition mod 2**32 commutes: the order of the programs cannot change
the result). One launch for every tensor of a device, one read of each byte, one read-back.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from weight_sync.quant.fp8_triton import _launch_device, launch_table

__all__ = ["word_sums"]

_PERIOD = 65521
_BLOCK = 4096


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def sums(table_ptr, out_ptr, PERIOD: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(1)
        chunk = tl.program_id(0)
        n = tl.load(table_ptr + b * 2 + 1)  # words
        start = chunk.to(tl.int64) * PERIOD
        if start >= n:
            return
        words = tl.load(table_ptr + b * 2).to(tl.pointer_type(tl.int32)) + start
        plain = tl.zeros([BLOCK], dtype=tl.int32)
        weighted = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, PERIOD, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            x = tl.load(words + j, mask=(j < PERIOD) & (start + j < n), other=0)
            plain += x
            weighted += x * (j + 1)
        tl.atomic_add(out_ptr + b * 2, tl.sum(plain, axis=0))
        tl.atomic_add(out_ptr + b * 2 + 1, tl.sum(weighted, axis=0))

    return sums


def word_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """int64 ``[len(tensors), 2]`` on their device: each tensor's (plain, weighted) word sums mod 2**32.

    Every tensor is contiguous, non-empty, of a byte length that is a multiple of 4, 4-byte aligned, and
    on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``); they stay alive until the launch is
    enqueued (the table holds raw pointers).
    """
    device = tensors[0].device
    rows: list[int] = []
    most = 0
    for t in tensors:
        n = t.numel() * t.element_size() // 4
        rows += (t.data_ptr(), n)
        most = max(most, -(-n // _PERIOD))
    table = launch_table(rows, device)
    out = torch.zeros((len(tensors), 2), dtype=torch.int32, device=device)
    with _launch_device(tensors[0]):
        _kernel()[(most, len(tensors))](table, out, PERIOD=_PERIOD, BLOCK=_BLOCK)
    return out.to(torch.int64).bitwise_and_(0xFFFFFFFF)

