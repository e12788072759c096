"""Decoding delta payloads staged one after another in one buffer, addressed by offsets: no tensor per payload.

The bucket decode (``weight_sync.transport.delta_batch``) already decodes a bucket's payloads with one
set of launches, but it makes torch views of every payload (its header, its four regions, its
positions), and on the H100 hosts each view costs microseconds: a dense model's bucket holds hundreds
of payloads, and the views, not the device, set the pace of a small model's delta apply. Here the
payloads lie in one staged buffer (an engine copies them out of the transport's buckets anyway) and
everything per payload is an integer in a numpy array:

- the headers and tables of all payloads come to the host in one gather (their bytes listed by
  numpy) and are checked in one numpy pass (:func:`~weight_sync.transport.delta_batch.tables`);
- the bitmask chunks are gathered as rows of an overlapping strided view of the buffer's 8-byte words
  (one index per chunk, not per byte) and unpacked together;
- the index offsets of every chunk are read in place through one gather whose addresses a
  ``repeat_interleave`` of the per-chunk table builds on the device;
- each payload's positions are a run of one of the two position lists and its values a run of the
  buffer: the caller writes them by address (``weight_sync.reload.scatter_many.scatter_rows``).

The checks are the bucket decode's, made per chunk where it made them per bucket (each bitmask chunk
holds as many changes as its table says), evaluated on the device and read back once by the caller.
Payloads this decode does not take (another layout, plain chunks, chunk sizes that are not a multiple
of 64) are the caller's to decode one by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weight_sync.reload.lanes import to_device
from weight_sync.transport.delta import Checks, _bits, _divmod, packed_offsets
from weight_sync.transport.delta_batch import Tables, tables
from weight_sync.transport.delta_format import DEFAULT_CHUNK_ELEMS, FORM_BITMASK, FORM_INDEX

__all__ = ["StagedPositions", "decode_staged", "staged_tables"]


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenated ranges ``[starts[i], starts[i] + lengths[i])`` as one int64 array."""
    total = int(lengths.sum())
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if lengths.size else lengths
    return np.repeat(starts - before, lengths) + np.arange(total, dtype=np.int64)


def staged_tables(buf: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, numel: np.ndarray,
                  item: np.ndarray) -> Tables:
    """The :class:`~weight_sync.transport.delta_batch.Tables` of the payloads at byte ``offsets`` of ``buf``
    (``sizes`` bytes each, describing tensors of ``numel`` elements of ``item`` bytes): their leading
    bytes gathered in one launch and read back in one device sync."""
    heads = np.minimum(16 + 8 * -(-numel // DEFAULT_CHUNK_ELEMS), sizes)
    at = _runs(offsets, heads)
    flat = buf[to_device(torch.from_numpy(at), buf.device)].cpu().numpy() if at.size else np.zeros(0, np.uint8)
    return tables(flat, heads, numel, item, sizes)


@dataclass(slots=True, eq=False)
class StagedPositions:
    """Positions of decoded payloads (one entry per payload of the ``take`` passed to :func:`decode_staged`,
    in its order): payload ``i``'s changes in bitmask chunks are ``bpos[b_start[i] : b_start[i] + n_bits[i]]``,
    then those in index chunks ``ipos[i_start[i] : i_start[i] + n_index[i]]``; its new values lie in
    that order at byte ``values_at[i]`` of the buffer."""

    bpos: torch.Tensor  # int64
    ipos: torch.Tensor  # int64
    b_start: np.ndarray
    i_start: np.ndarray
    n_bits: np.ndarray
    n_index: np.ndarray
    values_at: np.ndarray


def decodable(tab: Tables, offsets: np.ndarray) -> np.ndarray:
    """Which payloads :func:`decode_staged` takes (bool per payload): usable tables, no plain chunks,
    chunks of a multiple of 64 elements (whole 8-byte words of bits), 8-byte aligned in the buffer."""
    return tab.usable & (tab.n_plain_chunks == 0) & (tab.chunk_elems % 64 == 0) & (offsets % 8 == 0)


def decode_staged(buf: torch.Tensor, offsets: np.ndarray, tab: Tables, take: np.ndarray, numel: np.ndarray,
                  checks: Checks) -> list[tuple[np.ndarray, StagedPositions]]:
    """Positions of the payloads ``take`` (indices into ``offsets``/``tab``/``numel``, each
    :func:`decodable`), one set of launches per chunk size: ``(indices, positions)`` per chunk size
    (in practice one). The checks go to ``checks``, unread: nothing here waits for the device."""
    if buf.numel() % 8 or buf.data_ptr() % 8:
        raise ValueError("decode_staged: the staged buffer must be whole, aligned 8-byte words")
    out = []
    ce_of = tab.chunk_elems[take]
    for ce in np.unique(ce_of).tolist():
        sel = take[ce_of == ce]
        out.append((sel, _decode_one_size(buf, offsets, tab, sel, numel, int(ce), checks)))
    return out


def _decode_one_size(buf: torch.Tensor, offsets: np.ndarray, tab: Tables, sel: np.ndarray, numel: np.ndarray,
                     ce: int, checks: Checks) -> StagedPositions:
    dev = buf.device
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    off, ra = offsets[sel], tab.region_at[sel]
    nb, ni = tab.n_bits[sel], tab.n_index[sel]
    b_start = np.concatenate([[0], np.cumsum(nb)[:-1]]).astype(np.int64) if sel.size else nb
    i_start = np.concatenate([[0], np.cumsum(ni)[:-1]]).astype(np.int64) if sel.size else ni
    total_bits, total_index = int(nb.sum()), int(ni.sum())
    # Every chunk of the selected payloads, payload after payload: its payload (0..len(sel)), number
    # in its tensor, form and count.
    nc = tab.num_chunks[sel]
    first = np.concatenate([[0], np.cumsum(nc)[:-1]]) if sel.size else nc
    owner = np.repeat(np.arange(sel.size), nc)
    local = np.arange(int(nc.sum()), dtype=np.int64) - first[owner]
    at = tab.chunk_at[sel][owner] + local
    form, counts = tab.form[at], tab.counts[at]
    bm, ix = np.flatnonzero(form == FORM_BITMASK), np.flatnonzero(form == FORM_INDEX)

    # One host->device copy of the per-chunk lists: [bitmask: word start, chunk number, count |
    # index: offset-element start less the chunk's first output slot, chunk start + bias, count].
    words_per = ce // 64
    bm_owner = owner[bm]
    bm_rank = np.arange(bm.size) - np.concatenate([[0], np.cumsum(np.bincount(bm_owner, minlength=sel.size))])[bm_owner]
    bm_word = (off[bm_owner] + ra[bm_owner, 0]) // 8 + bm_rank * words_per
    ix_owner, ix_count = owner[ix], counts[ix]
    width = 2 if ce <= 1 << 16 else 4
    out_first = np.concatenate([[0], np.cumsum(ix_count)[:-1]]) if ix.size else ix_count
    # An index chunk's offsets follow its payload's earlier index chunks' in the offsets region.
    before_in_payload = out_first - i_start[ix_owner]
    src_first = (off[ix_owner] + ra[ix_owner, 1]) // width + before_in_payload
    bias = 1 << 15 if width == 2 else 0
    packed = np.concatenate([bm_word, local[bm], counts[bm],
                             src_first - out_first, local[ix] * ce + bias, ix_count]).astype(np.int64)
    lists = to_device(torch.from_numpy(packed), dev) if packed.size else empty
    k = bm.size
    bm_chunk, bm_count = lists[k : 2 * k], lists[2 * k : 3 * k]
    ix_table = lists[3 * k :].view(3, -1) if ix.size else empty.view(3, 0)

    bpos = empty
    if k:
        words = buf.view(torch.int64)
        # Row r of this view is the chunk of bits starting at word r: one index per chunk gathers
        # whole chunks (an index per byte would be as large as the bitmasks, eight times over).
        rows = words.as_strided((words.numel() - words_per + 1, words_per), (1, 1))
        raw = rows[lists[:k]].view(torch.uint8)  # [chunks, ce / 8]
        bits = ((raw.view(-1, 1) & _bits(dev)) != 0).view(k, ce)
        checks.append(((bits.sum(1) != bm_count).any(), "a bitmask chunk holds a different number of changes "
                                                        "than its table says"))
        hit = torch.nonzero_static(bits.view(-1), size=total_bits).reshape(-1)
        g, within = _divmod(hit.clamp(min=0), ce)
        bpos = bm_chunk[g] * ce + within

    ipos = empty
    if total_index:
        both = torch.repeat_interleave(ix_table[:2], ix_table[2], dim=1, output_size=total_index)
        src = both[0].add_(torch.arange(total_index, device=dev))
        stored, _ = packed_offsets(buf, ce)  # the whole buffer as offsets: read at ``src``
        got = stored[src]
        if ce < 1 << 16:
            checks.append(((got >= ce - bias).any(), f"an index offset is outside its chunk of {ce} elements"))
        ipos = both[1].add_(got)
        if total_index > 1:
            # Increasing inside each tensor; a tensor's first offset follows another tensor's last.
            worse = ipos[1:] <= ipos[:-1]
            bounds = i_start[1:][(i_start[1:] > 0) & (i_start[1:] < total_index)]
            if bounds.size:
                worse[to_device(torch.from_numpy(bounds - 1), dev)] = False
            checks.append((worse.any(), "index offsets repeat or are out of order"))

    # Each tensor's last position in either list against its size, in one comparison.
    has_b, has_i = nb > 0, ni > 0
    lasts = np.concatenate([(b_start + nb - 1)[has_b], total_bits + (i_start + ni - 1)[has_i]])
    if lasts.size:
        limits = np.concatenate([numel[sel][has_b], numel[sel][has_i]])
        table = to_device(torch.from_numpy(np.stack([lasts, limits]).astype(np.int64)), dev)
        where = table[0]
        last = ipos[(where - total_bits).clamp(min=0)] if total_index else where
        if total_bits:
            last = torch.where(where < total_bits, bpos[where.clamp(max=total_bits - 1)], last)
        checks.append(((last >= table[1]).any(), "a changed position lies beyond its tensor's elements"))
    values_at = off + ra[:, 2]
    return StagedPositions(bpos, ipos, b_start, i_start, nb, ni, values_at)
