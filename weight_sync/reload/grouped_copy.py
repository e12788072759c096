"""Many device-to-device copies in one launch: the queued small writes of a reload at memory speed.

A MoE layer arrives as hundreds of ~3 MB expert slices. One ``copy_`` each costs more host time than
device time, and ``torch._foreach_copy_`` (the multi-tensor kernels) launches a kernel per ~13 such
tensors with per-launch host metadata. Here one Triton program copies one chunk of one tensor: the
launch table holds ``(src, dst, words)`` per tensor and the grid is ``(chunks of the longest, tensors)``,
programs past their tensor's end return at once. Words are 4 bytes; a copy whose pointers or length are
not 4-byte multiples (or that is not contiguous, or mixes devices or dtypes) goes through
``torch._foreach_copy_`` instead, as does everything off CUDA or without Triton. Bytes are copied
unchanged, so the result is bitwise the one of ``dst.copy_(src)`` for same-dtype contiguous tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from functools import reduce
from operator import or_
from typing import Any

import numpy as np
import torch

from weight_sync.layers.accessors import data_ptr, is_contiguous
from weight_sync.layers.source_guard import LaunchTables
from weight_sync.quant.fp8_triton import _launch_device, triton_available

__all__ = ["CopyGroup", "copy_many"]

# Words per program: a 3 MB expert slice is 96 programs. Measured on the H200 (6144 slices of 768 x 2048
# bf16 in one launch): 1.065x one flat copy of the same bytes with 32 KB programs, 1.107x with 256 KB ones.
_CHUNK = 1 << 13
_BLOCK = 2048  # words per step: 16 per thread of 4 warps, four 16-byte accesses
# Tensors per launch: a grid's second dimension is at most 65535.
_MAX_GROUP = 32768


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_words(table_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
        t = tl.program_id(1)
        n = tl.load(table_ptr + t * 3 + 2)
        start = tl.program_id(0).to(tl.int64) * CHUNK
        if start >= n:
            return
        src = tl.load(table_ptr + t * 3).to(tl.pointer_type(tl.int32))
        dst = tl.load(table_ptr + t * 3 + 1).to(tl.pointer_type(tl.int32))
        if VEC:
            # Every pointer and length of this launch is a multiple of 16 bytes: 16-byte accesses.
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
            n = tl.multiple_of(n, 4)
        end = tl.minimum(start + CHUNK, n)
        for j0 in range(0, CHUNK, BLOCK):
            j = start + j0 + tl.arange(0, BLOCK)
            ok = j < end
            tl.store(dst + j, tl.load(src + j, mask=ok), mask=ok)

    return copy_words


def copy_many(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``d.copy_(s)`` for every pair, as few launches as the tensors allow (see the module docstring).

    The pairs must not overlap one another (as for ``torch._foreach_copy_``); each source stays alive
    until the launch is enqueued, which it is when this returns.
    """
    if not dst:
        return
    if not (dst[0].is_cuda and triton_available()):
        torch._foreach_copy_(list(dst), list(src))
        return
    _copy_grouped(dst, src)


def _copy_grouped(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """The Triton path of :func:`copy_many` (CUDA; CPU tensors only under ``TRITON_INTERPRET=1``)."""
    first = dst[0]
    rows: list[int] = []
    most = 0
    vec = True
    rest_dst: list[torch.Tensor] = []
    rest_src: list[torch.Tensor] = []
    device, dtype = first.device, first.dtype
    for d, s in zip(dst, src, strict=True):
        nbytes = d.nbytes
        sp, dp = s.data_ptr(), d.data_ptr()
        if (s.dtype is not dtype or d.dtype is not dtype or s.device != device or d.device != device
                or s.shape != d.shape or (sp | dp | nbytes) & 3 or not (d.is_contiguous() and s.is_contiguous())):
            rest_dst.append(d)
            rest_src.append(s)
            continue
        if (sp | dp | nbytes) & 15:
            vec = False
        words = nbytes >> 2
        rows += (sp, dp, words)
        most = max(most, words)
    if rows:
        _launch(torch.tensor(rows, dtype=torch.int64).view(-1, 3), -(-most // _CHUNK), vec, first)
    if rest_dst:
        torch._foreach_copy_(rest_dst, rest_src)


class CopyGroup:
    """The destinations of a grouped copy that repeats (a replayed bucket list): checked and tabled once.

    :meth:`copy` then costs one pass over the sources' pointers: the caller has checked that each source
    has its destination's shape, dtype and device (``ListReplay`` does); what is left to check here is
    what only the sources can say - contiguity and alignment - and a list failing it goes through
    ``torch._foreach_copy_`` like :func:`copy_many`'s rest.
    """

    __slots__ = ("chunks", "dst", "last", "vec", "words")

    def __init__(self, dst: Sequence[torch.Tensor]) -> None:
        self.dst = list(dst)
        self.words: np.ndarray | None = None  # [n, 2] int64: (dst pointer, words), when launchable
        self.vec = False
        self.chunks = 0
        self.last = LaunchTables()  # the last launch's device table, while the sources stay where they were
        if not (dst and dst[0].is_cuda and triton_available()):
            return
        dtype, device = dst[0].dtype, dst[0].device
        ptrs = list(map(data_ptr, self.dst))
        sizes = [d.nbytes for d in self.dst]
        if not all(d.dtype is dtype and d.device == device and d.is_contiguous() for d in self.dst):
            return
        flags = 0
        for p, n in zip(ptrs, sizes):
            flags |= p | n
        if flags & 3:
            return
        self.vec = not flags & 15
        self.words = np.array([ptrs, [n >> 2 for n in sizes]], dtype=np.int64).T.copy()
        self.chunks = -(-max(sizes) // 4 // _CHUNK)

    def copy(self, src: list[torch.Tensor], contiguous: bool = False) -> None:
        """``d.copy_(s)`` for the group's destinations and ``src`` (same shapes, dtypes and device; known
        to be contiguous when ``contiguous``)."""
        if not self.dst:
            return
        words = self.words
        if words is None or not (contiguous or all(map(is_contiguous, src))):
            torch._foreach_copy_(self.dst, list(src))
            return
        last = self.last
        if last.reusable(src):
            table, vec = last.tables
            _launch_on_device(table, vec, self.chunks, self.dst[0])
            return
        ptrs = list(map(data_ptr, src))
        low = reduce(or_, ptrs, 0)
        if low & 3:
            torch._foreach_copy_(self.dst, list(src))
            return
        table = torch.empty((len(self.dst), 3), dtype=torch.int64, pin_memory=True)  # words: CUDA only
        # Filled through numpy: a list of ints converts there at a third of torch.tensor's cost.
        view = table.numpy()
        view[:, 0] = ptrs
        view[:, 1:] = words
        dev_table, vec = table.to(self.dst[0].device, non_blocking=True), self.vec and not low & 15
        last.keep(ptrs, (dev_table, vec), dev_table.device)
        _launch_on_device(dev_table, vec, self.chunks, self.dst[0])


def _launch(table: torch.Tensor, chunks: int, vec: bool, first: torch.Tensor) -> None:
    """Launch the copy kernel over a host table ``[n, 3]`` of (src, dst, words) on ``first``'s device (CPU
    only under ``TRITON_INTERPRET=1``)."""
    if first.is_cuda:
        # Copied to the device without waiting, in stream order before the launch.
        table = (table if table.is_pinned() else table.pin_memory()).to(first.device, non_blocking=True)
    _launch_on_device(table, vec, chunks, first)


def _launch_on_device(table: torch.Tensor, vec: bool, chunks: int, first: torch.Tensor) -> None:
    """Launch the copy kernel over ``table`` (on ``first``'s device), at most _MAX_GROUP tensors a launch."""
    kernel = _kernel()
    with _launch_device(first):
        for i in range(0, table.shape[0], _MAX_GROUP):
            part = table[i:i + _MAX_GROUP]
            kernel[(chunks, part.shape[0])](part, CHUNK=_CHUNK, BLOCK=_BLOCK, VEC=vec, num_warps=4)
