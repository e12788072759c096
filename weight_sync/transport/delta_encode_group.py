"""Encoding a group of tensors' deltas together on a device: one set of launches for all of them.

The per-tensor torch encoder costs some thirty small launches and host steps per tensor, so a CUDA
sender of a few hundred tensors was host-bound (measured on an H200: 0.5 ms per tensor, 215 ms for the
310 tensors of a 0.6B model whose compare pass takes 3 ms). Here a group of tensors of one item size is
laid out as one flat buffer in which every tensor starts on a chunk boundary (the padding is zero in
both versions, so it never counts as a change): per-chunk counts of *every* tensor come from one
compare and one row sum, read back once; the host then decides each chunk's form and where each region
of each tensor's encoding lands in one output buffer (numpy over the per-chunk table, a few thousand
entries); the device writes the changed values, index offsets, bitmask bytes and heads of all tensors
with a handful of scatters. Each tensor's encoding is a slice of that buffer, byte for byte what
:func:`weight_sync.transport.delta.encode_delta` writes for it alone (the format is described there).

Elements of plain chunks appear among the changed positions too; their scatters are sent to a scratch
word at the end of the buffer (outside every encoding) rather than filtered out, which would need a
second nonzero or a device sync.
"""

from __future__ import annotations

import numpy as np
import torch

from weight_sync.errors import LayoutMismatchError
from weight_sync.reload.lanes import to_device
from weight_sync.transport.delta import _as_int, _bits, _check_chunk_elems, _check_pair, _divmod
from weight_sync.transport.delta_format import (
    _INT_OF_SIZE,
    FORM_BITMASK,
    FORM_INDEX,
    FORM_PLAIN,
    MAGIC,
    OFFSET16_BIAS,
    _offset_bytes,
    forms_of_sizes,
)

__all__ = ["encode_group"]

def _align8(n: np.ndarray) -> np.ndarray:
    return (n + 7) // 8 * 8


def _within_tensor(x: np.ndarray, owner: np.ndarray, chunk_start: np.ndarray) -> np.ndarray:
    """Exclusive cumulative sum of a per-chunk ``x`` restarted at every tensor's first chunk."""
    incl = np.concatenate([[0], np.cumsum(x)])
    return incl[:-1] - incl[chunk_start][owner]


def _per_tensor(x: np.ndarray, chunk_start: np.ndarray) -> np.ndarray:
    """Per-tensor sums of a per-chunk ``x``."""
    incl = np.concatenate([[0], np.cumsum(x)])
    return incl[chunk_start[1:]] - incl[chunk_start[:-1]]


def encode_group(pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk_elems: int, *, advance: bool = False
                 ) -> list[tuple[torch.Tensor, int]]:
    """The delta encoding of every ``(new, base)`` pair and its changed-element count, in order.

    Every ``new`` lies on one device and all pairs share one item size (1, 2, 4 or 8 bytes); a base
    may be elsewhere (a pinned host copy) and is copied over. ``advance``: every base is then moved to
    its new tensor (a copy of the whole group on the device; on the host only the changed elements).
    Costs two group-sized staging buffers and a byte mask on the device, one host sync.
    """
    if not pairs:
        return []
    _check_chunk_elems(chunk_elems)
    dev = pairs[0][0].device
    item = pairs[0][0].dtype.itemsize
    if item not in _INT_OF_SIZE:
        raise LayoutMismatchError(f"delta encoding needs an item size of 1, 2, 4 or 8 bytes, got {pairs[0][0].dtype}")
    for new, base in pairs:
        _check_pair(new, base)
        if new.device != dev or new.dtype.itemsize != item:
            raise LayoutMismatchError(f"a delta group holds one device and item size: expected {dev}, {item} "
                                      f"bytes, got {new.device}, {new.dtype.itemsize}")
    ints = _INT_OF_SIZE[item]
    ce = chunk_elems
    numels = np.array([new.numel() for new, _ in pairs], dtype=np.int64)
    nchunks = -(-numels // ce)
    chunk_start = np.concatenate([[0], np.cumsum(nchunks)])
    num_chunks = int(chunk_start[-1])

    # Both versions laid out chunk-aligned; zero padding (equal in both) never reads as a change.
    staged_new = torch.zeros(num_chunks * ce, dtype=ints, device=dev)
    staged_old = torch.zeros(num_chunks * ce, dtype=ints, device=dev)
    news = [_as_int(new.detach()) for new, _ in pairs]
    olds = [_as_int(base.detach()) for _, base in pairs]
    at = (chunk_start[:-1] * ce).tolist()
    torch._foreach_copy_([staged_new[a : a + n.numel()] for a, n in zip(at, news)], news)
    if all(o.device == dev for o in olds):
        torch._foreach_copy_([staged_old[a : a + o.numel()] for a, o in zip(at, olds)], olds)
    else:
        # Host bases: asynchronous copies (a blocking copy per tensor ran at ~33 GB/s of ~55 from pinned
        # memory). The bases are written next only after the read-back of the counts, which waits for them.
        for a, o in zip(at, olds):
            staged_old[a : a + o.numel()].copy_(o, non_blocking=True)
    mask = staged_new != staged_old
    counts = mask.view(num_chunks, ce).sum(1).cpu().numpy() if num_chunks else np.zeros(0, np.int64)
    num_changed = int(counts.sum())

    # The table, decided on the host for every chunk of every tensor at once.
    owner = np.repeat(np.arange(len(pairs)), nchunks)
    sizes = np.full(num_chunks, ce, dtype=np.int64)
    last = chunk_start[1:][nchunks > 0] - 1
    sizes[last] = numels[nchunks > 0] - (nchunks[nchunks > 0] - 1) * ce
    form = forms_of_sizes(counts, sizes, ce, item)
    is_bm, is_ix, is_pl = form == FORM_BITMASK, form == FORM_INDEX, form == FORM_PLAIN
    ob = _offset_bytes(ce)
    n_bm = _per_tensor(is_bm.astype(np.int64), chunk_start)
    k_bm = _per_tensor(np.where(is_bm, counts, 0), chunk_start)
    k_ix = _per_tensor(np.where(is_ix, counts, 0), chunk_start)
    plain_elems = _per_tensor(np.where(is_pl, sizes, 0), chunk_start)
    head = 16 + 8 * nchunks
    r_bits = _align8(head)
    r_offsets = r_bits + _align8(n_bm * ce // 8)
    r_values = r_offsets + _align8(k_ix * ob)
    r_plain = r_values + _align8((k_bm + k_ix) * item)
    total = r_plain + _align8(plain_elems * item)
    start = np.concatenate([[0], np.cumsum(total)])
    scratch = int(start[-1])  # one 8-byte word past every encoding: where the plain chunks' scatters go
    out = torch.zeros(scratch + 8, dtype=torch.uint8, device=dev)

    # Heads: magic, chunk size, chunk count, item size, then (form, count) per chunk.
    head_words = np.empty(int(head.sum()) // 4, dtype=np.int32)
    head_dst = np.empty_like(head_words, dtype=np.int64)
    head_at = np.concatenate([[0], np.cumsum(head // 4)])
    fixed = head_at[:-1][:, None] + np.arange(4)
    head_words[fixed] = np.array([MAGIC, ce, 0, item], dtype=np.int32)
    head_words[fixed[:, 2]] = nchunks
    head_dst[fixed] = start[:-1][:, None] // 4 + np.arange(4)
    rank = np.arange(num_chunks) - chunk_start[owner]
    table_at = head_at[owner] + 4 + 2 * rank
    head_words[table_at], head_words[table_at + 1] = form, counts
    head_dst[table_at] = start[owner] // 4 + 4 + 2 * rank
    head_dst[table_at + 1] = head_dst[table_at] + 1
    out.view(torch.int32)[to_device(torch.from_numpy(head_dst), dev)] = to_device(torch.from_numpy(head_words), dev)

    if num_changed:
        # Per chunk: the first changed element's index among all changes, and where its values and
        # offsets go (as element indices of the output viewed at that width); plain chunks -> scratch.
        first = np.concatenate([[0], np.cumsum(counts)])[:-1]
        base_of = start[owner]
        value_at = (base_of + r_values[owner]) // item + np.where(
            is_bm, _within_tensor(np.where(is_bm, counts, 0), owner, chunk_start),
            k_bm[owner] + _within_tensor(np.where(is_ix, counts, 0), owner, chunk_start))
        offset_at = (base_of + r_offsets[owner]) // ob + _within_tensor(np.where(is_ix, counts, 0), owner, chunk_start)
        table = np.stack([first, np.where(is_pl, scratch // item, value_at),
                          np.where(is_ix, offset_at, scratch // ob), is_ix, is_pl]).astype(np.int64)
        t = to_device(torch.from_numpy(np.ascontiguousarray(table.T)), dev)
        pos = torch.nonzero_static(mask, size=num_changed).reshape(-1)
        chunk, within = _divmod(pos, ce)
        row = t[chunk]
        r = torch.arange(num_changed, device=dev) - row[:, 0]
        keep = row[:, 4] == 0
        out.view(ints)[torch.where(keep, row[:, 1] + r, row[:, 1])] = staged_new[pos]
        offsets = within - OFFSET16_BIAS if ob == 2 else within
        out.view(torch.int16 if ob == 2 else torch.int32)[torch.where(row[:, 3] == 1, row[:, 2] + r, row[:, 2])] = (
            offsets.to(torch.int16 if ob == 2 else torch.int32))
        bm_chunks = np.flatnonzero(is_bm)
        if bm_chunks.size:
            rows = mask.view(num_chunks, ce)[to_device(torch.from_numpy(bm_chunks), dev)]
            packed = (rows.view(-1, ce // 8, 8).to(torch.uint8) * _bits(dev)).sum(-1, dtype=torch.uint8)
            bits_at = (base_of + r_bits[owner] + _within_tensor(is_bm.astype(np.int64), owner, chunk_start) * (ce // 8))[bm_chunks]
            dst = to_device(torch.from_numpy(bits_at), dev)[:, None] + torch.arange(ce // 8, device=dev)
            out[dst.reshape(-1)] = packed.reshape(-1)
        _copy_plain(out.view(ints), staged_new, is_pl, sizes, owner, chunk_start, start, r_plain, item, ce)

    if advance:
        _advance(pairs, staged_new, mask if num_changed else None, at, num_changed)
    per_tensor_changed = _per_tensor(counts, chunk_start)
    return [(out[int(s) : int(s + n)], int(k)) for s, n, k in zip(start[:-1], total, per_tensor_changed)]


def _copy_plain(out_items: torch.Tensor, staged: torch.Tensor, is_pl: np.ndarray, sizes: np.ndarray,
                owner: np.ndarray, chunk_start: np.ndarray, start: np.ndarray, r_plain: np.ndarray,
                item: int, ce: int) -> None:
    """Every value of the plain chunks, one slice copy per run of consecutive plain chunks of a tensor
    (plain chunks are the dense ones: rare at the densities delta sync is for)."""
    chunks = np.flatnonzero(is_pl)
    if not chunks.size:
        return
    dst_rank = _within_tensor(np.where(is_pl, sizes, 0), owner, chunk_start)
    run_starts = np.flatnonzero(np.diff(chunks, prepend=-2) != 1)
    run_ends = np.append(run_starts[1:], chunks.size)
    for a, b in zip(run_starts, run_ends):
        c0, c1 = int(chunks[a]), int(chunks[b - 1])
        # A run may cross into the next tensor: split it where the owner changes.
        while c0 <= c1:
            i = int(owner[c0])
            end = min(c1, int(chunk_start[i + 1]) - 1)
            n = int(sizes[c0 : end + 1].sum())
            d = (int(start[i]) + int(r_plain[i])) // item + int(dst_rank[c0])
            out_items[d : d + n] = staged[c0 * ce : c0 * ce + n]
            c0 = end + 1


# Host bases: scattering the changes costs ~10 ns per changed element (positions and values read back,
# then a numpy scatter: 5-10 ns measured per element at 2-10% density); copying the whole group back
# costs its bytes at the pinned D2H rate (~50 GB/s; 25 GB/s assumed). Scatter only below that cost.
_SCATTER_BYTES_PER_CHANGE = 250


def scatter_pays(num_changed: int, group_bytes: int) -> bool:
    """Whether moving host bases by scattering ``num_changed`` elements beats copying ``group_bytes``."""
    return num_changed * _SCATTER_BYTES_PER_CHANGE < group_bytes


def _advance(pairs: list[tuple[torch.Tensor, torch.Tensor]], staged_new: torch.Tensor, mask: torch.Tensor | None,
             at: list[int], num_changed: int) -> None:
    """Move every base to its new tensor: a grouped copy when the bases share the device; host bases
    get only the changed elements (read back once for the group) when few changed, else a copy back of
    every tensor (an H100 sender of a bf16 8B model encoded a 2% delta in 3.9 s with the scatter, 0.5 s
    with nothing changed; a copy back of its 16 GB is ~0.3 s at the pinned rate)."""
    if mask is None:
        return
    bases = [base for _, base in pairs]
    news = [new.detach() for new, _ in pairs]
    if all(b.device == staged_new.device for b in bases):
        torch._foreach_copy_(bases, news)
        return
    if not scatter_pays(num_changed, sum(b.numel() * b.element_size() for b in bases)):
        for b, n in zip(bases, news):
            b.copy_(n, non_blocking=True)
        # Copies into page-locked memory return before they land: the base is read by the host next
        # (a fallback full update sends it), so the group waits here, as its read-back did above.
        if staged_new.device.type == "cuda":
            torch.cuda.current_stream(staged_new.device).synchronize()
        return
    pos = torch.nonzero_static(mask, size=num_changed).reshape(-1)
    _scatter_changed(bases, at, pos.cpu().numpy(), staged_new[pos].cpu().numpy())


def _scatter_changed(bases: list[torch.Tensor], at: list[int], pos: np.ndarray, vals: np.ndarray) -> None:
    """Write the changed values into host bases: ``pos`` are sorted positions in the group's layout,
    where base ``i`` starts at element ``at[i]``."""
    bounds = np.searchsorted(pos, np.array([*at, np.iinfo(np.int64).max], dtype=np.int64))
    for base, a, lo, hi in zip(bases, at, bounds[:-1], bounds[1:]):
        if hi > lo:
            if not base.is_contiguous():
                raise LayoutMismatchError(f"delta base must be contiguous, got strides {base.stride()}")
            _as_int(base.detach()).numpy()[pos[lo:hi] - a] = vals[lo:hi]
