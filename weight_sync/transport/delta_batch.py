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

from weight_sync import native
from weight_sync.reload.lanes import to_device
from weight_sync.transport.delta import (
    FORM_BITMASK,
    FORM_INDEX,
    Checks,
    _bits,
    _divmod,
    _parse,
    _Parsed,
    decode_delta,
    decode_parsed,
    packed_offsets,
    raise_failed,
    read_heads,
)
from weight_sync.transport.delta_format import _INT_OF_SIZE, FORM_PLAIN, MAGIC

__all__ = ["Tables", "decode_deltas", "decode_together", "head_tables", "parse_many", "tables"]


@dataclass(slots=True, eq=False)  # not frozen: its __init__ runs per payload of every delta
class _Item:
    index: int  # into the caller's list
    parsed: _Parsed
    numel: int


def decode_deltas(items: list[tuple[torch.Tensor, int, torch.dtype]], arena: native.HostArena | None = None,
                  parsed: list[_Parsed] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~weight_sync.transport.delta.decode_delta` of every ``(payload, numel, dtype)``: the same
    (positions, values) per payload, in order, every payload checked before this returns. Payloads on
    the host are parsed together and decoded one by one (numpy's decode has no launches to save),
    their positions written into ``arena`` where one is given; those on a device are decoded together
    per chunk size, their checks read back once. A failed batch check is re-run payload by payload so
    the error names the payload's problem. ``parsed``: the parses of every item (``parse_many``'s), all
    on the host, where the caller made them already.
    """
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(items)
    on_device: dict[torch.device, list[int]] = {}
    on_host: list[int] = []
    for i, (payload, _, _) in enumerate(items):
        (on_host if payload.device.type == "cpu" else on_device.setdefault(payload.device, [])).append(i)
    if on_host:
        # Parsed together (a per-payload parse is tens of microseconds of numpy calls), decoded one by
        # one: the native / numpy decode has no launches to save, and checks each payload as it goes.
        # (On two threads it was no faster: the decode is quick next to each payload's Python.)
        cpu = torch.device("cpu")
        for i, p in zip(on_host, parse_many([items[i] for i in on_host]) if parsed is None else parsed):
            out[i] = decode_parsed(p, items[i][1], cpu, None, arena)
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
    for i, p in enumerate(parse_many(items)):
        numel = items[i][1]
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
    # (One pass over the concatenated tables: chunk numbers are local to each payload.)
    nc = np.array([it.parsed.num_chunks for it in group], dtype=np.int64)
    forms = np.concatenate([it.parsed.form for it in group]) if group else np.zeros(0, np.int64)
    counts = np.concatenate([it.parsed.counts for it in group]) if group else np.zeros(0, np.int64)
    local = np.arange(forms.size) - np.repeat(np.concatenate([[0], np.cumsum(nc)[:-1]]), nc)
    bm_at, ix_at = np.flatnonzero(forms == FORM_BITMASK), np.flatnonzero(forms == FORM_INDEX)
    packed = np.concatenate([local[bm_at], local[ix_at], counts[ix_at]]).astype(np.int64)
    lists = to_device(torch.from_numpy(packed), dev) if packed.size else empty
    n_bm_chunks, n_ix_chunks = bm_at.size, ix_at.size
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
        # Each change's chunk start (plus the offsets' storage bias), repeated, and its offset added in
        # place from the packed integers: two passes over the positions instead of five (at 2% of an 8B
        # model they are 164 M int64s).
        off, bias = packed_offsets(raw, ce)
        if ce < 1 << 16:
            checks.append(((off >= ce - bias).any(), f"an index offset is outside its chunk of {ce} elements"))
        start = ix_chunk * ce + bias
        ipos_all = torch.repeat_interleave(start, ix_count, output_size=total_index).add_(off)
        if total_index > 1:
            # Increasing inside each tensor; a tensor's first offset follows another tensor's last.
            worse = ipos_all[1:] <= ipos_all[:-1]
            starts = np.cumsum([it.parsed.n_index for it in group])[:-1]
            starts = starts[starts < total_index]
            if starts.size:
                worse[to_device(torch.from_numpy(starts - 1), dev)] = False
            checks.append((worse.any(), "index offsets repeat or are out of order"))

    # Every tensor's last bitmask and last index position against its size, in one comparison (read
    # from both position lists in place: no concatenation of them).
    lasts, limits = [], []
    b_at = i_at = 0
    out = []
    # Each tensor's positions as views of the batch's lists, made by one split per list (a slice per
    # tensor costs a torch call each).
    n_bits = [it.parsed.n_bits for it in group]
    n_index = [it.parsed.n_index for it in group]
    bparts = bpos_all.split_with_sizes(n_bits) if total_bits else [empty] * len(group)
    iparts = ipos_all.split_with_sizes(n_index) if total_index else [empty] * len(group)
    for it, nb, ni, bpos, ipos in zip(group, n_bits, n_index, bparts, iparts):
        b_at += nb
        i_at += ni
        if nb:
            lasts.append(b_at - 1)
            limits.append(it.numel)
        if ni:
            lasts.append(total_bits + i_at - 1)
            limits.append(it.numel)
        pos = bpos if not ni else ipos if not nb else torch.cat([bpos, ipos])
        out.append((pos, it.parsed.regions[2]))
    if lasts:
        table = to_device(torch.from_numpy(np.array([lasts, limits], dtype=np.int64)), dev)
        at = table[0]  # into bpos_all below total_bits, else into ipos_all (after total_bits)
        last = ipos_all[(at - total_bits).clamp(min=0)] if total_index else at
        if total_bits:
            last = torch.where(at < total_bits, bpos_all[at.clamp(max=total_bits - 1)], last)
        checks.append(((last >= table[1]).any(), "a changed position lies beyond its tensor's elements"))
    return out


@dataclass(slots=True, eq=False)
class Tables:
    """The headers and chunk tables of several payloads, read and checked together (numpy, one row or
    entry per payload): what :func:`parse_many` and the staged decode
    (``weight_sync.transport.delta_staged``) take each payload's layout from."""

    usable: np.ndarray  # bool: laid out as the batched readers expect and consistent (else parse alone)
    chunk_elems: np.ndarray
    num_chunks: np.ndarray
    n_plain_chunks: np.ndarray
    n_bits: np.ndarray  # changes in bitmask chunks
    n_index: np.ndarray  # changes in index chunks
    region_at: np.ndarray  # [payloads, 5]: byte offsets of the four regions in the payload, then its end
    lengths: np.ndarray  # [payloads, 4]: the regions' bytes (unpadded)
    form: np.ndarray  # per chunk of every usable payload, payload after payload
    counts: np.ndarray
    chunk_at: np.ndarray  # [payloads + 1]: where each payload's chunks start in form / counts


def tables(flat: np.ndarray, sizes: np.ndarray, numel: np.ndarray, item: np.ndarray,
           payload_bytes: np.ndarray) -> Tables:
    """The :class:`Tables` of payloads whose leading bytes (:func:`~weight_sync.transport.delta.head_bytes`
    each, or the whole payload when shorter) lie one after another in ``flat`` (``sizes`` bytes each):
    every header and table checked in one numpy pass against the tensor of ``numel`` elements of
    ``item`` bytes it claims to describe, and the payload's ``payload_bytes``. A payload failing a
    check, or whose table is not all in its leading bytes (another chunk size), is not ``usable``."""
    n = sizes.size
    starts = np.concatenate([[0], np.cumsum(sizes)])
    usable = (sizes >= 16) & (starts[:-1] % 4 == 0)
    if flat.size % 4 or not usable.any():
        usable[:] = False
    ints = flat[: flat.size // 4 * 4].view(np.int32)
    word = np.where(usable, starts[:-1] // 4, 0)
    magic, ce, nc, got_item = (ints[word + k].astype(np.int64) if ints.size else np.zeros(n, np.int64)
                               for k in range(4))
    safe_ce = np.maximum(ce, 8)
    usable &= ((magic == MAGIC) & (got_item == item) & (ce >= 8) & (nc == -(-numel // safe_ce))
               & (sizes >= 16 + 8 * nc))
    nc = np.where(usable, nc, 0)
    owner = np.repeat(np.arange(n), nc)
    chunk_at = np.concatenate([[0], np.cumsum(nc)])
    rank = np.arange(int(chunk_at[-1])) - chunk_at[owner]
    table_word = word[owner] + 4 + 2 * rank
    form = ints[table_word].astype(np.int64) if table_word.size else np.zeros(0, np.int64)
    counts = ints[table_word + 1].astype(np.int64) if table_word.size else np.zeros(0, np.int64)
    bad_form = np.bincount(owner, weights=(form.view(np.uint64) > FORM_PLAIN).astype(np.float64), minlength=n) > 0
    usable &= ~bad_form
    per = np.bincount(owner * 4 + np.clip(form, 0, 3), minlength=4 * n).reshape(-1, 4)
    changes = np.bincount(owner * 4 + np.clip(form, 0, 3), weights=counts, minlength=4 * n).reshape(-1, 4)
    last_plain = np.zeros(n, dtype=bool)
    has = nc > 0
    last_plain[has] = form[chunk_at[1:][has] - 1] == FORM_PLAIN
    n_plain = per[:, FORM_PLAIN] * ce - np.where(last_plain, nc * ce - numel, 0)
    n_bits, n_index = changes[:, FORM_BITMASK].astype(np.int64), changes[:, FORM_INDEX].astype(np.int64)
    offset_bytes = np.where(ce <= 1 << 16, 2, 4)
    lengths = np.stack([per[:, FORM_BITMASK] * (ce // 8), n_index * offset_bytes, (n_bits + n_index) * item,
                        n_plain * item], 1)
    region_at = (16 + (8 * nc + 7) // 8 * 8)[:, None] + np.concatenate(
        [np.zeros((n, 1), np.int64), np.cumsum((lengths + 7) // 8 * 8, 1)], 1)
    usable &= (region_at[:, 4] == payload_bytes) & (lengths.min(1) >= 0)
    return Tables(usable, ce, nc, per[:, FORM_PLAIN].astype(np.int64), n_bits, n_index, region_at, lengths,
                  form, counts, chunk_at)


def head_tables(items: list[tuple[torch.Tensor, int, torch.dtype]]) -> tuple[list[np.ndarray], Tables]:
    """The leading bytes of every ``(payload, numel, dtype)`` (all on one device, read in one device read)
    and their :class:`Tables`, a payload ``usable`` only where it is also a 1-D uint8 tensor."""
    heads = read_heads([(t, n) for t, n, _ in items])
    sizes = np.array([h.size for h in heads], dtype=np.int64)
    flat = np.concatenate(heads) if heads else np.zeros(0, np.uint8)
    tab = tables(flat, sizes, np.array([n for _, n, _ in items], dtype=np.int64),
                 np.array([d.itemsize for _, _, d in items], dtype=np.int64),
                 np.array([t.numel() for t, _, _ in items], dtype=np.int64))
    tab.usable &= np.array([t.dtype == torch.uint8 and t.dim() == 1 for t, _, _ in items], dtype=bool)
    return heads, tab


def parse_many(items: list[tuple[torch.Tensor, int, torch.dtype]],
               read: tuple[list[np.ndarray], Tables] | None = None, which: list[int] | None = None) -> list[_Parsed]:
    """``_parse`` of every ``(payload, numel, dtype)`` (all on one device), the headers and tables of all of
    them read in one device read and checked in one numpy pass (a per-payload parse costs tens of
    microseconds of host time, and a bucket holds hundreds). A payload that fails a check, or whose
    table is not all in its leading bytes (another chunk size), is parsed alone: that raises its own
    error or handles the other layout. ``read``: :func:`head_tables` of ``items`` already made;
    ``which``: parse only these items (their parses in that order)."""
    heads, tab = head_tables(items) if read is None else read
    pick = np.arange(len(items)) if which is None else np.asarray(which, dtype=np.int64)
    items = items if which is None else [items[i] for i in which]
    out: list[_Parsed | None] = [None] * len(items)
    form, counts = tab.form, tab.counts
    # Python lists for the per-payload loop: indexing numpy scalars costs more than the rest of it. A
    # torch view costs about a microsecond of host time: an empty region gets one shared empty tensor
    # (most payloads have one or two: no bitmask at a low density, no plain chunks below a dense one).
    ends = tab.region_at[pick, :4] + tab.lengths[pick]
    rows = zip(tab.usable[pick].tolist(), tab.region_at[pick].tolist(), ends.tolist(), tab.chunk_at[pick].tolist(),
               tab.chunk_at[pick + 1].tolist(), tab.chunk_elems[pick].tolist(), tab.num_chunks[pick].tolist(),
               tab.n_plain_chunks[pick].tolist(), tab.n_bits[pick].tolist(), tab.n_index[pick].tolist())
    dev = items[0][0].device if items else None
    e8 = torch.empty(0, dtype=torch.uint8, device=dev)
    empty: dict[torch.dtype, torch.Tensor] = {torch.uint8: e8}
    for i, ((payload, n, dtype), (ok, a, e, lo, hi, ce_i, nc_i, plain, bits, index)) in enumerate(zip(items, rows)):
        if not ok:
            out[i] = _parse(payload, n, dtype, heads[int(pick[i])])
            continue
        want = _INT_OF_SIZE[dtype.itemsize] if dtype != torch.bool else torch.uint8
        none = empty.get(want)
        if none is None:
            none = empty[want] = torch.empty(0, dtype=want, device=dev)
        a0, a1, a2, a3, _ = a
        e0, e1, e2, e3 = e
        # Unrolled over the four regions (bitmask, offsets: bytes; values, plain: the tensor's integers).
        r2 = none if a2 == e2 else payload[a2:e2] if want is torch.uint8 else payload[a2:e2].view(want)
        r3 = none if a3 == e3 else payload[a3:e3] if want is torch.uint8 else payload[a3:e3].view(want)
        regions = (e8 if a0 == e0 else payload[a0:e0], e8 if a1 == e1 else payload[a1:e1], r2, r3)
        out[i] = _Parsed(ce_i, nc_i, form[lo:hi], counts[lo:hi], regions, payload, plain, bits, index)
    return [p for p in out if p is not None]
