"""Delta encoding and position decoding on CPU: numpy, or the native kernels where they are built.

Both paths write and read exactly the bytes of the torch path in ``weight_sync/transport/delta.py``
(the format is described there). numpy replaces torch on CPU because an update encodes and decodes
every tensor, and torch's per-call overhead (some 40 small operations per tensor) cost more than the
compare pass itself (measured 0.4 vs 0.15 ms per tensor of a 91-tensor model). The native kernels
(``weight_sync.native``) replace numpy's passes over the changed elements, whose nonzero and fancy
indexing branch on every change: one scan finds the changes, gathers their values and (for a sender)
moves the base; one pass each decodes index and bitmask chunks' positions.
"""

from __future__ import annotations

from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from weight_sync import native
from weight_sync.errors import LayoutMismatchError
from weight_sync.transport.delta_format import (
    FORM_BITMASK,
    FORM_INDEX,
    FORM_PLAIN,
    MAGIC,
    OFFSET16_BIAS,
    _align8,
    _forms,
    _offset_bytes,
)

if TYPE_CHECKING:
    from weight_sync.transport.delta import _Parsed

__all__ = ["encode_cpu", "sparse_positions_cpu"]


def _chunk_rows(a: np.ndarray, chunks: np.ndarray, ce: int, pad: bool | None) -> np.ndarray:
    """The elements of ``a``'s ``chunks`` (sorted chunk numbers), concatenated: a short last chunk is
    padded to ``ce`` elements with ``pad``, or left short where ``pad`` is None."""
    full = a.size // ce
    head = chunks[chunks < full] if chunks.size and chunks[-1] >= full else chunks
    out = a[: full * ce].reshape(full, ce)[head].reshape(-1)
    if head.size == chunks.size:
        return out
    tail = a[full * ce :]
    if pad is not None:
        tail = np.concatenate([tail, np.full(ce - tail.size, pad, dtype=a.dtype)])
    return np.concatenate([out, tail])


def encode_cpu(vals: np.ndarray, old: np.ndarray, ce: int, item: int, *, advance: bool = False,
               positions: bool = True, arena: native.HostArena | None = None
               ) -> tuple[np.ndarray, np.ndarray | None, int, bool]:
    """``(encoding, sorted changed positions, changed count, advanced)`` of integer views ``vals`` over
    ``old``.

    ``advance``: the caller also wants ``old`` moved to ``vals`` (``old`` is its base, not a copy); the
    native scan does it as it goes and ``advanced`` says so, else the caller still has to.
    ``positions``: False when the caller needs only the count (positions None, unless ``advance`` was
    asked and could not be done here, the numpy path): the scan then writes into this thread's scratch
    buffers instead of fresh ones. ``arena``: where the encoding of a tensor
    with changes is written (else a fresh array).
    """
    numel = vals.size
    num_chunks = -(-numel // ce)
    mask: np.ndarray | None = None
    changed: np.ndarray | None = None  # the new values at ``pos``, where the scan gathered them
    # With 16-bit offsets (chunks of at most 64 Ki, the default) the scan writes each change's offset as
    # the encoding stores it, not its flat position: ``pos`` then holds those offsets, in chunk order.
    off16 = native.enabled() and ce <= 1 << 16
    if native.enabled():
        pos, changed, counts = native.delta_scan(vals, old, ce, advance=advance, scratch=not positions,
                                                 offsets=off16)
    else:
        positions = positions or advance  # the caller moves the base from them
        advance = False
        # numpy's compare and flatnonzero run ~2x faster than torch's CPU kernels on one thread (measured
        # on 24.6 Mi bf16 at 2% changed: 53-62 ms vs 88-129 ms on the loaded 2-core host; comparing 8-byte
        # words first and splitting the changed ones was slower again, 96-137 ms).
        mask = vals != old
        pos = np.flatnonzero(mask)  # sorted: element order
        counts = np.diff(np.searchsorted(pos, np.arange(num_chunks + 1, dtype=np.int64) * ce))
    if not pos.size:
        # Nothing changed (the usual case for most tensors of an RL step): the header and a table of
        # 'same' chunks, without the form decisions' dozen small-array operations.
        out = np.zeros(16 + _align8(8 * num_chunks), dtype=np.uint8)
        out[:16].view(np.int32)[:] = (MAGIC, ce, num_chunks, item)
        return out, np.empty(0, dtype=np.int64) if positions else None, 0, advance
    form = _forms(counts, ce, numel, item)
    is_bm, is_ix, is_pl = form == FORM_BITMASK, form == FORM_INDEX, form == FORM_PLAIN
    n_bm, n_ix, n_pl = int(is_bm.sum()), int(is_ix.sum()), int(is_pl.sum())
    all_plain = n_pl == num_chunks
    # Per change its chunk's form, unless every changed chunk has one form ('same' chunks hold none).
    uniform = all_plain or (not n_pl and not (n_bm and n_ix))
    elem_form = None if uniform else np.repeat(form, counts)

    def pick(kind: int) -> tuple[np.ndarray, np.ndarray]:
        """The changed positions (or offsets) of the chunks of form ``kind`` and their new values."""
        if elem_form is None:
            return pos, (vals[pos] if changed is None else changed)
        sel = elem_form == kind
        return pos[sel], (vals[pos[sel]] if changed is None else changed[sel])

    none = np.empty(0, dtype=pos.dtype)
    sel_b, v_b = pick(FORM_BITMASK) if n_bm and not all_plain else (none, none)
    sel_i, v_i = pick(FORM_INDEX) if n_ix and not all_plain else (none, none)
    n_plain = numel if all_plain else n_pl * ce - (num_chunks * ce - numel if n_pl and is_pl[-1] else 0)
    off_bytes = _offset_bytes(ce)
    # The regions' sizes first, then one buffer they are written into: the offsets and values go
    # straight to their place (at 2% of a 0.6B model they are 12 M entries, and every temporary of
    # that size, then copied, cost a pass and its page faults).
    sizes = (16 + 8 * num_chunks, n_bm * (ce // 8), sel_i.size * off_bytes, (sel_b.size + sel_i.size) * item,
             n_plain * item)
    starts = list(accumulate((_align8(n) for n in sizes), initial=0))
    out = np.empty(starts[-1], dtype=np.uint8) if arena is None else arena.take(starts[-1], np.uint8)
    for a, n, e in zip(starts, sizes, starts[1:]):
        out[a + n : e] = 0  # the alignment padding
    region = [out[a : a + n] for a, n in zip(starts, sizes)]
    head = region[0].view(np.int32)
    head[:4] = (MAGIC, ce, num_chunks, item)
    table = head[4:].reshape(num_chunks, 2)
    table[:, 0], table[:, 1] = form, counts
    if n_bm and not all_plain:
        if mask is not None:
            # The bitmask chunks' bits, chunk by chunk, bit k of byte j for element 8j + k: the
            # compare's mask packed (a short last chunk padded with unchanged elements).
            bits = _chunk_rows(mask, np.flatnonzero(is_bm), ce, False)
        elif off16:
            # The same bits set from the offsets, each in its chunk's rank among the bitmask chunks.
            rank = np.repeat(np.arange(n_bm, dtype=np.int64), counts[is_bm])
            bits = np.zeros(n_bm * ce, dtype=bool)
            bits[rank * ce + (sel_b ^ np.uint16(OFFSET16_BIAS))] = True
        else:
            # No mask was made (the scan emits positions): the same bits set from the positions.
            rank = np.cumsum(is_bm) - 1
            bits = np.zeros(n_bm * ce, dtype=bool)
            bits[rank[sel_b // ce] * ce + sel_b % ce] = True
        region[1][:] = np.packbits(bits, bitorder="little")
    if sel_i.size:
        pow2 = ce & (ce - 1) == 0
        if off16:
            region[2].view(np.uint16)[:] = sel_i  # stored by the scan as the encoding stores them
        elif off_bytes == 2:
            # offset - OFFSET16_BIAS as int16 is the offset's 16 bits with the top one flipped: the
            # positions truncated to 16 bits in place, masked to the chunk, the bit flipped.
            off = region[2].view(np.uint16)
            np.copyto(off, sel_i if pow2 else sel_i % ce, casting="unsafe")
            if pow2 and ce < 1 << 16:
                off &= ce - 1
            off ^= OFFSET16_BIAS
        else:
            np.copyto(region[2].view(np.int32), sel_i & (ce - 1) if pow2 else sel_i % ce, casting="unsafe")
    if sel_b.size or sel_i.size:
        sparse = region[3].view(vals.dtype)
        sparse[: sel_b.size] = v_b
        sparse[sel_b.size :] = v_i
    if n_plain:
        plain = region[4].view(vals.dtype)
        plain[:] = vals if all_plain else _chunk_rows(vals, np.flatnonzero(is_pl), ce, None)
    if positions and off16:
        pos = np.repeat(np.arange(num_chunks, dtype=np.int64) * ce, counts) + (pos ^ np.uint16(OFFSET16_BIAS))
    return out, pos if positions else None, int(pos.size), advance


def sparse_positions_cpu(p: _Parsed, numel: int, arena: native.HostArena | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat positions of an encoding's bitmask chunks' and index chunks' changes (each ascending),
    checked against the encoding's regions and the tensor: the CPU twin of the torch decoder. The native
    decode writes them into ``arena`` where one is given."""
    ce = p.chunk_elems
    bitmask, offsets, sparse, _ = p.regions
    form, counts = p.form, p.counts
    bpos = ipos = np.empty(0, dtype=np.int64)
    fast = native.enabled()
    if bitmask.numel():
        chunks = np.flatnonzero(form == FORM_BITMASK)
        if fast:
            bpos = native.bitmask_positions(bitmask.numpy(), chunks, ce, int(counts[chunks].sum()), arena)
        else:
            hit = np.flatnonzero(np.unpackbits(bitmask.numpy(), bitorder="little"))  # bit k of byte j: 8j + k
            c, within = np.divmod(hit, ce)
            bpos = chunks[c] * ce + within
    if offsets.numel():
        chunks = np.flatnonzero(form == FORM_INDEX)
        raw = offsets.numpy()
        if fast:
            ipos = native.index_positions(chunks, counts[chunks], raw, _offset_bytes(ce), ce, arena)
        else:
            if _offset_bytes(ce) == 2:
                off = raw.view(np.int16).astype(np.int64) + OFFSET16_BIAS
            else:
                off = raw.view(np.int32).astype(np.int64)
            if ce < 1 << 16 and bool((off >= ce).any()):  # int16 offsets cannot exceed a 64 Ki chunk
                raise LayoutMismatchError(f"delta payload: an index offset is outside its chunk of {ce} elements")
            ipos = np.repeat(chunks, counts[chunks]) * ce + off
            if ipos.size > 1 and bool((ipos[1:] <= ipos[:-1]).any()):
                raise LayoutMismatchError("delta payload: index offsets repeat or are out of order")
    if bpos.size + ipos.size != sparse.numel():
        raise LayoutMismatchError(
            f"delta payload: {bpos.size + ipos.size} changed positions but {sparse.numel()} values"
        )
    for part in (bpos, ipos):
        if part.size and int(part[-1]) >= numel:
            raise LayoutMismatchError(f"delta payload: a changed position lies beyond the tensor's {numel} elements")
    return torch.from_numpy(bpos), torch.from_numpy(ipos)
