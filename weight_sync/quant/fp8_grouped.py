"""Many fp8 quantizations in one launch: the fused kernel over a table of weights.

A reload quantizing key by key (``weight_sync.reload.bands``) asks for hundreds of small quantizations
per bucket - every expert's gate, up and down slice of a MoE model, every q/k/v/o of a dense one - and
each launch of :func:`~weight_sync.quant.fp8_triton.quantize_fp8_fused` costs tens of microseconds of
host time in Triton's dispatcher, more than the kernel itself for an expert's slice. Here the weights of
one call are described in one int64 table (pointers, sizes, strides, scale groups, first program)
copied to the device once, and one program per scale group of every weight - a flat grid, each program
reading its weight from an owner map - runs the fused kernel's body on the weight it reads from the
table: the same arithmetic on the same groups, bitwise the same bytes, one launch per kernel shape. (A
grid of (most groups, weights) left ~45% of a dense layer's programs idle: its k/v bands have 1/12
of the groups of its MLP weights.)
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
from weight_sync.quant.fp8_triton import _f32_bits, _launch_device, fused_geometry, launch_table

__all__ = ["GroupedBands", "GroupedMatrices", "quantize_fp8_grouped", "quantize_fp8_matrices_grouped"]



@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def fused_grouped(desc_ptr, owner_ptr, w0, q0, s0, eps_bits, fmax, BM: tl.constexpr, BK: tl.constexpr,
                      PER_ROW: tl.constexpr, ONE_PASS: tl.constexpr, ALIGNED: tl.constexpr):
        # Program p: scale group p - first[b] of weight b = owner[p], as program p - first[b] of `fused`
        # (fp8_triton.py) for that weight alone; w0/q0/s0 (the first weight's tensors) only give the
        # element types. A flat grid: no program idles, however unequal the weights.
        p = tl.program_id(0)
        b = tl.load(owner_ptr + p)
        d = desc_ptr + b * 12
        pid = p - tl.load(d + 11)
        w_ptr = tl.load(d).to(tl.pointer_type(w0.dtype.element_ty))
        q_ptr = tl.load(d + 1).to(tl.pointer_type(q0.dtype.element_ty))
        s_ptr = tl.load(d + 2).to(tl.pointer_type(s0.dtype.element_ty))
        n = tl.load(d + 3)
        k = tl.load(d + 4)
        stride_w = tl.load(d + 5)
        stride_q = tl.load(d + 6)
        group_rows = tl.load(d + 7)
        group_cols = tl.load(d + 8)
        col_groups = tl.load(d + 9)
        chunks = tl.load(d + 10)
        if ALIGNED:
            # What Triton infers for a weight passed as an argument (16-byte aligned pointers, sizes and
            # strides multiple of 16): without it no load or store is vectorized (~4x slower per byte).
            w_ptr = tl.multiple_of(w_ptr, 16)
            q_ptr = tl.multiple_of(q_ptr, 16)
            stride_w = tl.multiple_of(stride_w, 16)
            stride_q = tl.multiple_of(stride_q, 16)
            k = tl.multiple_of(k, 16)
            group_cols = tl.multiple_of(group_cols, 16)
        local = tl.arange(0, BM)
        rows = (pid // col_groups) * group_rows + local
        row_ok = (local < group_rows) & (rows < n)
        col0 = (pid % col_groups) * group_cols
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w + col0
        q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_q + col0
        if ONE_PASS:
            cols = tl.arange(0, BK)
            mask = row_ok[:, None] & ((cols < group_cols) & (col0 + cols < k))[None, :]
            x = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        else:
            bits = tl.zeros([BM], dtype=tl.int32)
            for c in range(chunks):
                cols = c * BK + tl.arange(0, BK)
                mask = row_ok[:, None] & ((cols < group_cols) & (col0 + cols < k))[None, :]
                x = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                bits = tl.maximum(bits, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
        if not PER_ROW:
            bits = tl.max(bits, axis=0)
        s = tl.math.div_rn(tl.maximum(bits, eps_bits).to(tl.float32, bitcast=True), fmax)
        if PER_ROW:
            tl.store(s_ptr + rows, s, mask=row_ok)
            s = s[:, None]
        else:
            tl.store(s_ptr + pid, s)
        if ONE_PASS:
            x = tl.clamp(tl.math.div_rn(x, s), -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_rows + cols[None, :], x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        else:
            for c in range(chunks):
                cols = c * BK + tl.arange(0, BK)
                mask = row_ok[:, None] & ((cols < group_cols) & (col0 + cols < k))[None, :]
                x = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.clamp(tl.math.div_rn(x, s), -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
                tl.store(q_rows + cols[None, :], x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                         mask=mask)

    return fused_grouped


def quantize_fp8_grouped(
    items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    granularity: str,
    block_size: tuple[int, int],
    fmax: float,
    eps: float,
) -> None:
    """Quantize every ``(w, q, s)``: ``w`` into the fp8 ``q`` and its fp32 scales ``s``, as
    :func:`~weight_sync.quant.fp8_triton.quantize_fp8_fused` would one by one, in one launch per kernel
    shape. Each ``w`` is non-empty, 2-D with unit column stride; ``q`` and ``s`` contiguous with the
    fused kernel's output shapes; all on one device. The inputs must stay alive
    until the launch is enqueued (they are, while this runs: the table holds raw pointers)."""
    if not items:
        return
    groups: dict[tuple, list[int]] = {}
    counts: dict[tuple, list[int]] = {}
    first: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for item in items:
        w, q, s = item
        n, k = w.shape
        g = fused_geometry(n, k, granularity, block_size)
        # One launch per kernel shape and source dtype (the table's pointers are typed by the first).
        aligned = (w.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0
                   and q.stride(0) % 16 == 0 and k % 16 == 0 and g.group_cols % 16 == 0)
        key = (g.bm, g.bk, g.per_row, g.chunks == 1, g.num_warps, w.dtype, aligned)
        first.setdefault(key, item)
        sizes = counts.setdefault(key, [])
        groups.setdefault(key, []).extend((w.data_ptr(), q.data_ptr(), s.data_ptr(), n, k, w.stride(0),
                                           q.stride(0), g.group_rows, g.group_cols, g.col_groups, g.chunks,
                                           sum(sizes)))
        sizes.append(g.groups)
    kernel = _kernel()
    eps_bits = _f32_bits(eps)
    device = items[0][0].device
    with _launch_device(items[0][0]):
        for key, rows in groups.items():
            bm, bk, per_row, one_pass, warps, _, aligned = key
            w0, q0, s0 = first[key]
            table = launch_table(rows, device)
            owner, programs = owner_map(counts[key], device)
            kernel[(programs,)](table, owner, w0, q0, s0, eps_bits, fmax, BM=bm, BK=bk, PER_ROW=per_row,
                                ONE_PASS=one_pass, ALIGNED=aligned, num_warps=warps, enable_fp_fusion=False)


def owner_map(counts: Sequence[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """(int32 tensor on ``device`` giving, for every program of a flat grid, the index of the weight it
    works on - ``counts[b]`` programs for weight ``b``, in order -, the number of programs).

    Copied from pinned memory without waiting, in stream order before the launch, as :func:`launch_table`.
    """
    sizes = torch.tensor(counts, dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), sizes)
    if device.type == "cuda":
        owner = owner.pin_memory().to(device, non_blocking=True)
    return owner, int(sizes.sum())


class GroupedBands:
    """The launches of :func:`quantize_fp8_grouped` into fixed destinations, tabled once.

    A replayed bucket list (``weight_sync.reload.replay``) quantizes the same bands into the same live
    ``(q, s)`` views at every update; only the sources change. Everything of the launch table but the
    source pointers - destination pointers, sizes, strides, scale groups, kernel shapes - is computed
    here, once, for sources that are contiguous, 16-byte aligned and of ``dtype`` (what a trainer's
    buckets hold). :meth:`launch` fills in the sources' pointers and launches, one kernel per shape as
    :func:`quantize_fp8_grouped` would, the same bytes; it returns False, having launched nothing, when a
    source is not contiguous or not aligned (the caller then quantizes them the general way).
    """

    __slots__ = ("device", "eps_bits", "fmax", "groups", "last", "n")

    def __init__(self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]], shapes: Sequence[tuple[int, int]],
                 dtype: torch.dtype, granularity: str, block_size: tuple[int, int], fmax: float, eps: float) -> None:
        self.n = len(targets)
        self.device = targets[0][0].device if targets else torch.device("cpu")
        self.fmax = fmax
        self.eps_bits = _f32_bits(eps)
        rows: dict[tuple, tuple[list[int], list[int], list[int]]] = {}
        for i, ((q, s), (n, k)) in enumerate(zip(targets, shapes, strict=True)):
            g = fused_geometry(n, k, granularity, block_size)
            aligned = q.data_ptr() % 16 == 0 and q.stride(0) % 16 == 0 and k % 16 == 0 and g.group_cols % 16 == 0
            key = (g.bm, g.bk, g.per_row, g.chunks == 1, g.num_warps, dtype, aligned)
            idx, table, counts = rows.setdefault(key, ([], [], []))
            idx.append(i)
            table.extend((0, q.data_ptr(), s.data_ptr(), n, k, k, q.stride(0), g.group_rows, g.group_cols,
                          g.col_groups, g.chunks, sum(counts)))
            counts.append(g.groups)
        # Per kernel shape: (key, its first item's index and (q, s) - they type the kernel's pointers -,
        # its items' indices (None: all), the [count, 12] host table with the source column zero, the
        # flat grid's owner map on the device (fixed with the targets: made once) and its program count).
        self.groups = [(key, idx[0], targets[idx[0]], None if len(idx) == self.n else np.array(idx, dtype=np.int64),
                        torch.tensor(table, dtype=torch.int64).view(-1, 12), *owner_map(counts, self.device))
                       for key, (idx, table, counts) in rows.items()]
        self.last = LaunchTables()  # the last launch's device tables, while the sources stay where they were

    def launch(self, srcs: list[torch.Tensor], contiguous: bool = False) -> bool:
        """Quantize ``srcs[i]`` (of the shape and dtype given at construction) into target ``i``; False,
        nothing launched, if a source is not contiguous (known to be when ``contiguous``) or not 16-byte
        aligned."""
        if len(srcs) != self.n:
            raise ValueError(f"GroupedBands: {self.n} destinations, {len(srcs)} sources")
        if not (contiguous or all(map(is_contiguous, srcs))):
            return False
        tables = self.last.tables if self.last.reusable(srcs) else None
        if tables is None:
            ptrs = list(map(data_ptr, srcs))
            if reduce(or_, ptrs, 0) & 15:
                return False
            # Host tables are filled through numpy: converting a list of ints there costs a third of
            # torch.tensor's per element (~40 vs ~130 ns: thousands of sources per update).
            column = np.array(ptrs, dtype=np.int64)
            tables = [_device_table(base, column if idx is None else column[idx], self.device)
                      for _, _, _, idx, base, _, _ in self.groups]
            self.last.keep(ptrs, tables, self.device)
        kernel = _kernel()
        with _launch_device(srcs[0]):
            for (key, i0, (q0, s0), _, _, owner, programs), dev_table in zip(self.groups, tables, strict=True):
                bm, bk, per_row, one_pass, warps, _, aligned = key
                kernel[(programs,)](dev_table, owner, srcs[i0], q0, s0, self.eps_bits, self.fmax,
                                    BM=bm, BK=bk, PER_ROW=per_row, ONE_PASS=one_pass, ALIGNED=aligned,
                                    num_warps=warps, enable_fp_fusion=False)
        return True


def _device_table(base: torch.Tensor, column: np.ndarray, device: torch.device) -> torch.Tensor:
    """``base`` with the sources' pointers in its first column, on ``device`` (through pinned memory on
    CUDA: copied in stream order, no host synchronization)."""
    on_cuda = device.type == "cuda"
    table = torch.empty(base.shape, dtype=torch.int64, pin_memory=on_cuda)
    table.copy_(base)
    table.numpy()[:, 0] = column
    return table.to(device, non_blocking=True) if on_cuda else table


# Tiles of the per-tensor kernels, as absmax_bits / tensor_cast (fp8_triton.py) use them.
_ABSMAX_TILE = (64, 256)
_CAST_TILE = (32, 128)
_MATRIX_FIELDS = 10


@functools.cache
def _matrix_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def absmax_grouped(desc_ptr, w0, bits_ptr, BM: tl.constexpr, BN: tl.constexpr, ALIGNED: tl.constexpr):
        # Program (pid, b): tile pid of band b, folded into its matrix's absmax bits by an integer atomic
        # max, as `absmax_bits` does for one weight; w0 (the first band) only gives the element type.
        b = tl.program_id(1)
        pid = tl.program_id(0)
        d = desc_ptr + b * 10
        if pid >= tl.load(d + 9):
            return
        w_ptr = tl.load(d).to(tl.pointer_type(w0.dtype.element_ty))
        n = tl.load(d + 3)
        k = tl.load(d + 4)
        stride_w = tl.load(d + 5)
        slot = tl.load(d + 7)
        col_tiles = tl.load(d + 8)
        if ALIGNED:  # as in fused_grouped: what Triton infers for an argument, so loads vectorize
            w_ptr = tl.multiple_of(w_ptr, 16)
            stride_w = tl.multiple_of(stride_w, 16)
            k = tl.multiple_of(k, 16)
        rows = (pid // col_tiles) * BM + tl.arange(0, BM)
        cols = (pid % col_tiles) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=mask, other=0.0)
        bits = tl.max(tl.max(x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
        tl.atomic_max(bits_ptr + slot, bits)

    @triton.jit
    def cast_grouped(desc_ptr, w0, q0, bits_ptr, eps_bits, fmax, BM: tl.constexpr, BN: tl.constexpr,
                     ALIGNED: tl.constexpr):
        # Program (pid, b): tile pid of band b cast with its matrix's scale, as `tensor_cast`; every band
        # of a matrix stores the same scale into the matrix's one-element scale.
        b = tl.program_id(1)
        pid = tl.program_id(0)
        d = desc_ptr + b * 10
        if pid >= tl.load(d + 9):
            return
        w_ptr = tl.load(d).to(tl.pointer_type(w0.dtype.element_ty))
        q_ptr = tl.load(d + 1).to(tl.pointer_type(q0.dtype.element_ty))
        s_ptr = tl.load(d + 2).to(tl.pointer_type(tl.float32))
        n = tl.load(d + 3)
        k = tl.load(d + 4)
        stride_w = tl.load(d + 5)
        stride_q = tl.load(d + 6)
        slot = tl.load(d + 7)
        col_tiles = tl.load(d + 8)
        if ALIGNED:
            w_ptr = tl.multiple_of(w_ptr, 16)
            q_ptr = tl.multiple_of(q_ptr, 16)
            stride_w = tl.multiple_of(stride_w, 16)
            stride_q = tl.multiple_of(stride_q, 16)
            k = tl.multiple_of(k, 16)
        s = tl.math.div_rn(tl.maximum(tl.load(bits_ptr + slot), eps_bits).to(tl.float32, bitcast=True), fmax)
        if pid == 0:
            tl.store(s_ptr, s)
        rows = (pid // col_tiles) * BM + tl.arange(0, BM)
        cols = (pid % col_tiles) * BN + tl.arange(0, BN)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=mask, other=0.0)
        x = tl.clamp(tl.math.div_rn(w.to(tl.float32), s), -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
        q = x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q, mask=mask)

    return absmax_grouped, cast_grouped


def _matrix_table(matrices: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
                  tile: tuple[int, int]) -> tuple[list[int], int]:
    rows: list[int] = []
    most = 1
    for slot, bands in enumerate(matrices):
        for w, q, s in bands:
            n, k = w.shape
            col_tiles = -(-k // tile[1])
            tiles = -(-n // tile[0]) * col_tiles
            most = max(most, tiles)
            rows.extend((w.data_ptr(), q.data_ptr(), s.data_ptr(), n, k, w.stride(0), q.stride(0), slot,
                         col_tiles, tiles))
    return rows, most


def quantize_fp8_matrices_grouped(
    matrices: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]],
    fmax: float,
    eps: float,
) -> None:
    """Per-tensor fp8 of whole matrices given as bands: each entry of ``matrices`` is the ``(w, q, s)``
    bands of one matrix (every row of it; ``s`` its one-element fp32 scale), quantized as
    :func:`~weight_sync.quant.fp8_triton.absmax_bits_fp8` and
    :func:`~weight_sync.quant.fp8_triton.tensor_cast_fp8` would the fused matrix, in two launches per
    source dtype (and alignment) for all of them. Bands are non-empty, 2-D with unit column stride, on one device, the
    bands of a matrix of one dtype; the inputs must stay alive until the launches are enqueued."""
    by_dtype: dict[tuple[torch.dtype, bool], list[Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
    for m in matrices:
        if m:
            aligned = all(w.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0 and w.stride(0) % 16 == 0
                          and q.stride(0) % 16 == 0 and w.shape[1] % 16 == 0 for w, q, _ in m)
            by_dtype.setdefault((m[0][0].dtype, aligned), []).append(m)
    absmax, cast = _matrix_kernels()
    eps_bits = _f32_bits(eps)
    for (_, aligned), group in by_dtype.items():
        w0, q0, _ = group[0][0]
        device = w0.device
        count = sum(len(m) for m in group)
        # One int32 absmax per matrix, MAX-folded by its bands' programs (non-negative float bits order
        # like the floats).
        bits = torch.zeros(len(group), dtype=torch.int32, device=device)
        with _launch_device(w0):
            rows, most = _matrix_table(group, _ABSMAX_TILE)
            absmax[(most, count)](launch_table(rows, device), w0, bits, BM=_ABSMAX_TILE[0], BN=_ABSMAX_TILE[1],
                                  ALIGNED=aligned, num_warps=8)
            rows, most = _matrix_table(group, _CAST_TILE)
            cast[(most, count)](launch_table(rows, device), w0, q0, bits, eps_bits, fmax,
                                BM=_CAST_TILE[0], BN=_CAST_TILE[1], ALIGNED=aligned, enable_fp_fusion=False)


class GroupedMatrices:
    """The two launches of :func:`quantize_fp8_matrices_grouped` into fixed destinations, tabled once.

    What :class:`GroupedBands` is for block and channel scales, for per-tensor ones: a replayed bucket
    list quantizes the same whole one-scale matrices (a fused qkv, an expert's gate and up) into the
    same live ``(q, s)`` views at every update. ``targets[i]`` is band ``i``'s ``(q rows, one-element
    scale)``; bands sharing a scale view are one matrix, and every band of each matrix is among the
    targets. Everything of the two launch tables but the source pointers is computed here, once, for
    contiguous, 16-byte aligned sources of ``dtype``; :meth:`launch` fills those in, zeroes the matrices'
    absmax bits and launches the absmax kernel, then the cast kernel - the same kernels on the same tiles
    as :func:`quantize_fp8_matrices_grouped`, bitwise the same bytes - or returns False, having launched
    nothing, for a source that is not contiguous or not aligned.
    """

    __slots__ = ("absmax", "cast", "device", "eps_bits", "fmax", "last", "matrices", "n", "targets0")

    def __init__(self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]], shapes: Sequence[tuple[int, int]],
                 dtype: torch.dtype, fmax: float, eps: float) -> None:
        self.n = len(targets)
        self.device = targets[0][0].device if targets else torch.device("cpu")
        self.fmax, self.eps_bits = fmax, _f32_bits(eps)
        slots: dict[int, int] = {}
        tables: tuple[list[int], list[int]] = ([], [])
        most = [1, 1]
        aligned = True
        for (q, s), (n, k) in zip(targets, shapes, strict=True):
            slot = slots.setdefault(s.data_ptr(), len(slots))
            aligned = aligned and q.data_ptr() % 16 == 0 and q.stride(0) % 16 == 0 and k % 16 == 0
            for i, tile in enumerate((_ABSMAX_TILE, _CAST_TILE)):
                col_tiles = -(-k // tile[1])
                tiles = -(-n // tile[0]) * col_tiles
                most[i] = max(most[i], tiles)
                tables[i].extend((0, q.data_ptr(), s.data_ptr(), n, k, k, q.stride(0), slot, col_tiles, tiles))
        self.matrices = len(slots)
        self.targets0 = targets[0] if targets else None
        # Per kernel: (the [n, 10] host table with the source column zero, programs per band); both
        # launches take the targets' alignment (the sources' is checked per launch).
        self.absmax = (torch.tensor(tables[0], dtype=torch.int64).view(-1, _MATRIX_FIELDS), most[0], aligned)
        self.cast = (torch.tensor(tables[1], dtype=torch.int64).view(-1, _MATRIX_FIELDS), most[1], aligned)
        self.last = LaunchTables()  # the last launch's device tables, while the sources stay where they were

    def launch(self, srcs: list[torch.Tensor], contiguous: bool = False) -> bool:
        """Quantize ``srcs[i]`` (of the shape and dtype given at construction) into target ``i``; False,
        nothing launched, if a source is not contiguous (known to be when ``contiguous``) or not 16-byte
        aligned."""
        if len(srcs) != self.n:
            raise ValueError(f"GroupedMatrices: {self.n} destinations, {len(srcs)} sources")
        if not self.n:
            return True
        if not (contiguous or all(map(is_contiguous, srcs))):
            return False
        (absmax_base, absmax_most, aligned), (cast_base, cast_most, _) = self.absmax, self.cast
        tables = self.last.tables if self.last.reusable(srcs) else None
        if tables is None:
            ptrs = list(map(data_ptr, srcs))
            if reduce(or_, ptrs, 0) & 15:
                return False
            column = np.array(ptrs, dtype=np.int64)  # (through numpy: see GroupedBands.launch)
            tables = (_device_table(absmax_base, column, self.device), _device_table(cast_base, column, self.device))
            self.last.keep(ptrs, tables, self.device)
        assert self.targets0 is not None
        q0 = self.targets0[0]
        absmax, cast = _matrix_kernels()
        bits = torch.zeros(self.matrices, dtype=torch.int32, device=self.device)
        with _launch_device(srcs[0]):
            absmax[(absmax_most, self.n)](tables[0], srcs[0], bits, BM=_ABSMAX_TILE[0],
                                          BN=_ABSMAX_TILE[1], ALIGNED=aligned, num_warps=8)
            cast[(cast_most, self.n)](tables[1], srcs[0], q0, bits, self.eps_bits, self.fmax,
                                      BM=_CAST_TILE[0], BN=_CAST_TILE[1], ALIGNED=aligned, enable_fp_fusion=False)
        return True
