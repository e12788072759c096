"""Decoding the delta payloads of one bucket together on a device: one set of launches for all of them.

A per-tensor decode (:func:`weight_sync.transport.delta.decode_delta`) costs some twenty small device
launches per tensor whatever its size; a bucket of a few hundred small tensors is then launch-bound.
Here the tables of every payload are read on the host (one read for the bucket), the per-chunk lists
they imply are packed into one small host array and sent once, and the bitmask and index regions of
all payloads are unpacked as one concatenation each: the positions of every tensor come out of the
same few launches, as contiguous slices whose bounds the tables give on the host.

The checks are those of the per-tensor decode (bit counts against the tables, offsets inside their
chunk, increasing offsets, positions inside the tensor), evaluated for the whole batch and read back
once. When one fails, the payloads are decoded again one by one, which raises the per-tensor error
naming what is wrong; nothing has been written by then. Payloads of other chunk sizes, and payloads
with plain chunks, take the per-tensor path (plain chunks list every element: dense, already a few
large launches).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weight_sync.reload.lanes import to_device
from weight_sync.transport.delta import (
    FORM_BITMASK,
    FORM_INDEX,
    Checks,
    _bits,
    _divmod,
    _parse,
    _Parsed,
    _unpack_offsets,
    decode_delta,
    decode_parsed,
    raise_failed,
    read_heads,
)

__all__ = ["decode_deltas", "decode_together"]


@dataclass(frozen=True, slots=True)
class _Item:
    index: int  # into the caller's list
    parsed: _Parsed
    numel: int


def decode_deltas(items: list[tuple[torch.Tensor, int, torch.dtype]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~weight_sync.transport.delta.decode_delta` of every ``(payload, numel, dtype)``: the same
    (positions, values) per payload, in order, every payload checked before this returns. Payloads on
    the host decode one by one (numpy's decode has no launches to save); those on a device are decoded
    together per chunk size, their checks read back once. A failed batch check is re-run payload by
    payload so the error names the payload's problem.
    """
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
    on_device: dict[torch.device, list[int]] = {}
    for i, (payload, numel, dtype) in enumerate(items):
        if payload.device.type == "cpu":
            out[i] = decode_delta(payload, numel, dtype)
        else:
            on_device.setdefault(payload.device, []).append(i)
    own: Checks = []
    for dev, at in on_device.items():
        for i, decoded in zip(at, decode_together([items[i] for i in at], dev, own)):
            out[i] = decoded
    if own:
        try:
            raise_failed(own)
        except Exception:
            # Name the payload: the per-tensor decode raises its own message for the first bad one.
            for payload, numel, dtype in items:
                decode_delta(payload, numel, dtype)
            raise
    return [o for o in out if o is not None]


def decode_together(items: list[tuple[torch.Tensor, int, torch.dtype]], dev: torch.device,
                    checks: Checks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batched decode of payloads on ``dev`` (what :func:`decode_deltas` runs for a device; any
    device works, CPU included): their checks go to ``checks``, unread."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
    groups: dict[int, list[_Item]] = {}
    for i, ((payload, numel, dtype), head) in enumerate(zip(items, read_heads([(t, n) for t, n, _ in items]))):
        p = _parse(payload, numel, dtype, head)
        if p.n_plain_chunks:
            out[i] = decode_parsed(p, numel, dev, checks)
            continue
        groups.setdefault(p.chunk_elems, []).append(_Item(i, p, numel))
    for ce, group in groups.items():
        for item, decoded in zip(group, _decode_group(group, ce, dev, checks)):
            out[item.index] = decoded
    return [o for o in out if o is not None]


def _decode_group(group: list[_Item], ce: int, dev: torch.device, checks: Checks) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Positions and values of payloads of one chunk size, decoded with one set of launches."""
    empty = torch.empty(0, dtype=torch.int64, device=dev)
    # Host side: each change's chunk comes from the tables; the per-chunk lists of the batch go to
    # the device in one copy: [bitmask chunk ids | index chunk ids | index chunk counts].
    bm_ids = [np.flatnonzero(it.parsed.form.numpy() == FORM_BITMASK) for it in group]
    ix_ids = [np.flatnonzero(it.parsed.form.numpy() == FORM_INDEX) for it in group]
    ix_counts = [it.parsed.counts.numpy()[ids] for it, ids in zip(group, ix_ids)]
    packed = np.concatenate([*bm_ids, *ix_ids, *ix_counts]).astype(np.int64)
    lists = to_device(torch.from_numpy(packed), dev) if packed.size else empty
    n_bm_chunks = sum(ids.size for ids in bm_ids)
    n_ix_chunks = sum(ids.size for ids in ix_ids)
    bm_chunk = lists[:n_bm_chunks]
    ix_chunk, ix_count = lists[n_bm_chunks : n_bm_chunks + n_ix_chunks], lists[n_bm_chunks + n_ix_chunks :]

    bpos_all = empty
    total_bits = sum(it.parsed.n_bits for it in group)
    if n_bm_chunks:
        # Every bitmask region is whole chunks of ce bits: concatenated, bit g * ce + w is offset w of the
        # batch's bitmask chunk g, whose chunk number bm_chunk[g] is in its own tensor.
        raw = torch.cat([it.parsed.regions[0] for it in group if it.parsed.regions[0].numel()])
        bits = ((raw.view(-1, 1) & _bits(dev)) != 0).view(-1)
        hit = torch.nonzero_static(bits, size=total_bits).reshape(-1)
        checks.append((bits.sum() != total_bits, f"the bitmasks of a bucket hold a different number of changes "
                                                 f"than their tables' {total_bits}"))
        g, within = _divmod(hit.clamp(min=0), ce)
        bpos_all = bm_chunk[g] * ce + within

    ipos_all = empty
    total_index = sum(it.parsed.n_index for it in group)
    if total_index:
        raw = torch.cat([it.parsed.regions[1] for it in group if it.parsed.regions[1].numel()])
        off = _unpack_offsets(raw, ce)
        if ce < 1 << 16:
            checks.append(((off >= ce).any(), f"an index offset is outside its chunk of {ce} elements"))
        ipos_all = torch.repeat_interleave(ix_chunk, ix_count, output_size=total_index) * ce + off
        if total_index > 1:
            # Increasing inside each tensor; a tensor's first offset follows another tensor's last.
            worse = ipos_all[1:] <= ipos_all[:-1]
            starts = np.cumsum([it.parsed.n_index for it in group])[:-1]
            starts = starts[starts < total_index]
            if starts.size:
                worse[to_device(torch.from_numpy(starts - 1), dev)] = False
            checks.append((worse.any(), "index offsets repeat or are out of order"))

    # Every tensor's last bitmask and last index position against its size, in one comparison.
    lasts, limits = [], []
    b_at = i_at = 0
    out = []
    for it in group:
        bpos = bpos_all[b_at : b_at + it.parsed.n_bits]
        ipos = ipos_all[i_at : i_at + it.parsed.n_index]
        b_at += it.parsed.n_bits
        i_at += it.parsed.n_index
        if it.parsed.n_bits:
            lasts.append(b_at - 1)
            limits.append(it.numel)
        if it.parsed.n_index:
            lasts.append(total_bits + i_at - 1)
            limits.append(it.numel)
        sparse = it.parsed.regions[2]
        pos = bpos if not ipos.numel() else ipos if not bpos.numel() else torch.cat([bpos, ipos])
        out.append((pos, sparse))
    if lasts:
        both = torch.cat([bpos_all, ipos_all])
        table = to_device(torch.from_numpy(np.array([lasts, limits], dtype=np.int64)), dev)
        checks.append(((both[table[0]] >= table[1]).any(), "a changed position lies beyond its tensor's elements"))
    return out
