"""Many scattered writes into many tensors in one launch: a delta bucket's changed values put in place.

A delta update writes each changed tensor's new values at its changed positions: a norm's few dozen
elements, an embedding's millions, a quantized weight's model-format copy. One ``t[idx] = v`` per
tensor costs tens of microseconds of host time in torch's advanced indexing (an index kernel for the
old values, an index_put for the new, a handful of small tensors for the checksum move), and a bucket
of a dense model holds hundreds of such tensors: the host, not the device, set the pace of a delta's
apply on the H200.

Here every write of one item size is a row group of one int64 table: (destination, positions, values,
old values, count, element offset, checksum slot), each row at most ``_CHUNK`` elements of one write,
and one Triton program per row reads the positions and values, and - for writes into live tensors -
reads the old values, stores them (for rollback), adds the checksum move of its elements to its
tensor's slot with two atomic adds, then stores the new values. The checksum arithmetic is
:func:`weight_sync.reload.delta_checksum.checksum_changes`' (the fingerprint's two 32-bit word sums, each
term reduced mod 2**32), so the slots hold what that function sums; integer addition commutes, so the
result does not depend on the order the programs run in. Positions inside one launch are distinct
(a key's positions increase; two keys never share a destination, see ``plan_routes``), so neither do
the stores.

Off CUDA or without Triton, :func:`scatter_many` returns False and the caller writes tensor by tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weight_sync.quant.fp8_triton import _launch_device, triton_available

__all__ = ["ScatterWrite", "grouped_scatter_available", "scatter_many", "scatter_rows"]

_CHUNK = 1 << 13  # elements per program
_BLOCK = 1024  # elements per step of a program
_ROW = 7  # int64 words per table row
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@dataclass(slots=True, eq=False)
class ScatterWrite:
    """``dst.view(-1)[offset + pos] = vals`` (as integers of one item size): ``pos`` int64, ``vals`` of
    ``dst``'s item size, both contiguous on ``dst``'s device. (Not frozen: a delta makes one per changed
    tensor, and a frozen dataclass's __init__ costs about a microsecond more of host time.)"""

    dst: torch.Tensor
    offset: int
    pos: torch.Tensor
    vals: torch.Tensor


def grouped_scatter_available(device: torch.device) -> bool:
    """Whether :func:`scatter_many` can write on ``device`` (CUDA with Triton)."""
    return device.type == "cuda" and triton_available()


def _groupable(w: ScatterWrite, device: torch.device, itemsize: int) -> bool:
    return (w.dst.device == device and w.dst.is_contiguous() and w.dst.element_size() == itemsize
            and w.vals.element_size() == itemsize and w.vals.device == device and w.vals.is_contiguous()
            and w.pos.dtype == torch.int64 and w.pos.device == device and w.pos.is_contiguous()
            and w.pos.numel() == w.vals.numel())


def scatter_many(writes: list[ScatterWrite], itemsize: int, *, old: torch.Tensor | None = None,
                 sums: torch.Tensor | None = None, slots: list[int] | None = None, interpret: bool = False) -> bool:
    """Write every ``writes`` entry in one launch; returns False (nothing written) when it cannot.

    With ``old`` (an integer tensor of ``sum(w.pos.numel())`` elements of ``itemsize``), the values each
    write overwrote go there, write after write in list order; with ``sums`` (int64 ``[slots, 2]``) and
    ``slots`` (one per write), each write's checksum move ``[plain, weighted]`` (mod 2**32 per term, as
    :func:`~weight_sync.reload.delta_checksum.checksum_changes`) is added to its slot's row. The launch is
    queued on the current stream: the tensors must stay alive until it ran (stream order). It cannot
    when the device is not CUDA with Triton (``interpret``: the CPU tests, under TRITON_INTERPRET=1), the
    item size is not 1, 2 or 4, or any write is not contiguous on that device at that item size.
    """
    if not writes:
        return True
    device = writes[0].dst.device
    if itemsize not in _INT or not (interpret or grouped_scatter_available(device)):
        return False
    if not all(_groupable(w, device, itemsize) for w in writes):
        return False
    keep = old is not None
    if keep and (sums is None or slots is None or len(slots) != len(writes)):
        raise ValueError("scatter_many: old values come with checksum sums and one slot per write")
    counts = np.fromiter((w.pos.numel() for w in writes), dtype=np.int64, count=len(writes))
    total = int(counts.sum())
    if keep and (old is None or old.numel() != total or old.element_size() != itemsize or not old.is_contiguous()):
        raise ValueError(f"scatter_many: old must hold {total} contiguous elements of {itemsize} bytes")
    dst = np.fromiter((w.dst.data_ptr() for w in writes), dtype=np.int64, count=len(writes))
    pos = np.fromiter((w.pos.data_ptr() for w in writes), dtype=np.int64, count=len(writes))
    val = np.fromiter((w.vals.data_ptr() for w in writes), dtype=np.int64, count=len(writes))
    off = np.fromiter((w.offset for w in writes), dtype=np.int64, count=len(writes))
    scatter_rows(writes[0].vals.view(_INT[itemsize]), dst, pos, val, counts, off,
                 slots=np.asarray(slots, dtype=np.int64) if keep and slots is not None else None,
                 old=old if keep else None, sums=sums if keep else None)
    return True


def scatter_rows(typed: torch.Tensor, dst: np.ndarray, pos: np.ndarray, val: np.ndarray, counts: np.ndarray,
                 offsets: np.ndarray, *, slots: np.ndarray | None = None, old: torch.Tensor | None = None,
                 sums: torch.Tensor | None = None) -> None:
    """:func:`scatter_many` by address: write ``i`` puts ``counts[i]`` values of ``typed``'s dtype from
    address ``val[i]`` at the int64 positions at address ``pos[i]`` (plus ``offsets[i]``) of the
    tensor at address ``dst[i]``. ``typed`` (an integer tensor on the device, of the values' item
    size) gives the element type and the device. With ``old`` (contiguous, ``counts.sum()`` elements)
    the overwritten values go there in write order, and with ``sums`` and ``slots`` each write's
    checksum move goes to its slot's row, as in :func:`scatter_many`. The caller vouches for every
    address (live, on the device, holding what the counts say) and for the launch being possible
    (:func:`grouped_scatter_available`, or the interpreter)."""
    itemsize = typed.element_size()
    keep = old is not None
    total = int(counts.sum())
    if old is not None and (sums is None or slots is None or old.numel() != total):
        raise ValueError(f"scatter_rows: old values ({total}) come with checksum sums and one slot per write")
    if total == 0:
        return
    device = typed.device
    rows_of = -(-counts // _CHUNK)
    owner = np.repeat(np.arange(counts.size), rows_of)
    first_row = np.concatenate([[0], np.cumsum(rows_of)[:-1]])
    start = (np.arange(owner.size) - first_row[owner]) * _CHUNK
    before = np.concatenate([[0], np.cumsum(counts)[:-1]])
    table = torch.empty((owner.size, _ROW), dtype=torch.int64, pin_memory=device.type == "cuda")
    t = table.numpy()
    t[:, 0] = dst[owner]
    t[:, 1] = pos[owner] + start * 8
    t[:, 2] = val[owner] + start * itemsize
    t[:, 3] = (old.data_ptr() + (before[owner] + start) * itemsize) if old is not None else 0
    t[:, 4] = np.minimum(counts[owner] - start, _CHUNK)
    t[:, 5] = offsets[owner]
    t[:, 6] = slots[owner] if keep and slots is not None else 0
    dev_table = table.to(device, non_blocking=True) if device.type == "cuda" else table
    acc = sums if keep and sums is not None else torch.zeros(2, dtype=torch.int64, device=device)
    with _launch_device(typed):
        _kernel()[(owner.size,)](dev_table, acc, typed, KEEP=keep, ITEM=itemsize, CHUNK=_CHUNK, BLOCK=_BLOCK,
                                 num_warps=4)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def scatter_rows(table_ptr, sums_ptr, v0, KEEP: tl.constexpr, ITEM: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK: tl.constexpr):
        # Row r: up to CHUNK elements of one write (module docstring); v0 only gives the element type.
        row = table_ptr + tl.program_id(0).to(tl.int64) * 7
        dst = tl.load(row).to(tl.pointer_type(v0.dtype.element_ty))
        pos = tl.load(row + 1).to(tl.pointer_type(tl.int64))
        val = tl.load(row + 2).to(tl.pointer_type(v0.dtype.element_ty))
        old = tl.load(row + 3).to(tl.pointer_type(v0.dtype.element_ty))
        n = tl.load(row + 4)
        off = tl.load(row + 5)
        plain = tl.zeros([BLOCK], dtype=tl.int64)
        weighted = tl.zeros([BLOCK], dtype=tl.int64)
        for j0 in range(0, CHUNK, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            ok = j < n
            p = tl.load(pos + j, mask=ok, other=0) + off
            v = tl.load(val + j, mask=ok, other=0)
            if KEEP:
                o = tl.load(dst + p, mask=ok, other=0)
                tl.store(old + j, o, mask=ok)
                # The checksum move of this element (delta_checksum.checksum_changes): its word's term,
                # the element's bytes placed inside the little-endian word, each term mod 2**32.
                bits = (1 << (8 * ITEM)) - 1
                d = (v.to(tl.int64) & bits) - (o.to(tl.int64) & bits)
                byte = p * ITEM
                if ITEM < 4:
                    d = d << ((byte & 3) * 8)
                d = d & 0xFFFFFFFF
                w = (d * ((byte >> 2) % 65521 + 1)) & 0xFFFFFFFF
                plain += tl.where(ok, d, 0)
                weighted += tl.where(ok, w, 0)
            tl.store(dst + p, v, mask=ok)
        if KEEP:
            slot = tl.load(row + 6)
            tl.atomic_add(sums_ptr + slot * 2, tl.sum(plain, axis=0))
            tl.atomic_add(sums_ptr + slot * 2 + 1, tl.sum(weighted, axis=0))

    return scatter_rows
