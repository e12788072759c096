"""Delta encoding: a tensor as the exact byte changes against its base version, decoded in place.

Change detection compares *bytes*, never values: both tensors are viewed as integers of their item size,
so ``-0.0`` vs ``0.0`` and two NaNs with different payloads count as changes and an unchanged NaN does
not. There is no tolerance: applying the encoding to the base gives the new tensor bit for bit.

A tensor's flat elements are cut into chunks of ``chunk_elems`` (a multiple of 8). Each chunk picks the
smallest of four forms, from its element count ``n``, its changed count ``k`` and the item size ``s``:

- *same*: nothing changed (0 bytes beyond the table entry);
- *bitmask*: ``chunk_elems / 8`` bytes of change bits + the ``k`` new values (``k * s``);
- *index*: ``k`` offsets inside the chunk + the ``k`` new values (``2k + k * s``; offsets are int16,
  stored as ``offset - 32768``, for chunks of up to 64 Ki elements, int32 (``4k``) for larger ones);
- *plain*: all ``n`` new values (``n * s``): chosen whenever the encoding would not be smaller.

Wire layout (one uint8 tensor, self-describing; every region starts on an 8-byte boundary)::

    int32[4]   magic, chunk_elems, num_chunks, item size
    int32[2c]  (form, k) per chunk
    uint8[]    bitmasks of the bitmask chunks, chunk order (chunk_elems / 8 bytes each)
    int16[]    offsets of the index chunks, chunk order (int32 for chunks over 64 Ki elements)
    item[]     new values of the changed elements of the bitmask chunks, then of the index chunks,
               each group in element order
    item[]     every value of the plain chunks, chunk order

Grouping the regions by form (instead of chunk by chunk) makes both directions a handful of vectorized
tensor operations whatever the number of chunks: no Python loop over chunks, the same code on CPU and
CUDA. Encoding costs one compare pass and one ``nonzero``; the rest works on the changed positions and
the per-chunk table. Limitations: chunks below 2**31 elements, dtypes of item size 1, 2, 4 or 8 bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from weight_sync import native
from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.reload.lanes import to_device
from weight_sync.transport.delta_cpu import encode_cpu, sparse_positions_cpu
from weight_sync.transport.delta_format import (
    _INT_OF_SIZE,
    DEFAULT_CHUNK_ELEMS,
    FORM_BITMASK,
    FORM_INDEX,
    FORM_PLAIN,
    FORM_SAME,
    MAGIC,
    OFFSET16_BIAS,
    _align8,
    _forms,
    _offset_bytes,
)

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "FORM_BITMASK",
    "FORM_INDEX",
    "FORM_PLAIN",
    "FORM_SAME",
    "Checks",
    "DeltaStats",
    "apply_delta_",
    "changed_mask",
    "copy_changed_",
    "decode_delta",
    "decode_parsed",
    "delta_stats",
    "encode_delta",
    "encode_delta_with_positions",
    "encode_deltas",
    "head_bytes",
    "raise_failed",
    "read_heads",
]

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_BITS_ON: dict[torch.device, torch.Tensor] = {}


def _bits(dev: torch.device) -> torch.Tensor:
    """:data:`_BITS` on ``dev``, copied there once."""
    t = _BITS_ON.get(dev)
    if t is None:
        t = _BITS_ON[dev] = _BITS.to(dev)
    return t


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and reinterpreted as integers of its item size (a view: the same bytes)."""
    size = t.dtype.itemsize
    if size not in _INT_OF_SIZE:
        raise LayoutMismatchError(f"delta encoding needs an item size of 1, 2, 4 or 8 bytes, got {t.dtype}")
    flat = t.reshape(-1)
    if t.dtype == torch.bool:
        return flat.view(torch.uint8)
    return flat.view(_INT_OF_SIZE[size])


def changed_mask(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of the elements whose bytes differ between ``new`` and ``base`` (same dtype, shape)."""
    _check_pair(new, base)
    return _as_int(new.contiguous()) != _as_int(base.contiguous().to(new.device))


@dataclass(frozen=True, slots=True)
class DeltaStats:
    """What an encoding holds: elements, changed elements, chunks per form, its size and the plain size."""

    numel: int
    num_changed: int
    chunks: tuple[int, int, int, int]  # same, bitmask, index, plain
    nbytes: int
    plain_nbytes: int


def _pack_offsets(offsets: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    if _offset_bytes(chunk_elems) == 2:
        return (offsets - OFFSET16_BIAS).to(torch.int16)
    return offsets.to(torch.int32)


def packed_offsets(raw: torch.Tensor, chunk_elems: int) -> tuple[torch.Tensor, int]:
    """An index region's offsets as stored (an integer view of ``raw``, no copy) and what each is
    stored less: an offset is ``view + bias``."""
    if _offset_bytes(chunk_elems) == 2:
        return raw.view(torch.int16), OFFSET16_BIAS
    return raw.view(torch.int32), 0


def _unpack_offsets(raw: torch.Tensor, chunk_elems: int) -> torch.Tensor:
    off, bias = packed_offsets(raw, chunk_elems)
    return off.to(torch.int64) + bias if bias else off.to(torch.int64)


def _plain_positions(plain_chunks: torch.Tensor, chunk_elems: int, numel: int, dev: torch.device,
                     on_device: torch.Tensor | None = None) -> torch.Tensor:
    """Flat positions of the plain chunks' elements, in order (only built when some chunks are plain);
    ``on_device``: the same chunk numbers already on ``dev``."""
    chunks = to_device(plain_chunks, dev) if on_device is None else on_device
    idx = (chunks.view(-1, 1) * chunk_elems + torch.arange(chunk_elems, device=dev)).reshape(-1)
    # Only the last chunk can be short, and its positions come last: a slice (a boolean index would
    # wait for the device).
    over = int(plain_chunks[-1]) * chunk_elems + chunk_elems - numel if plain_chunks.numel() else 0
    return idx[: idx.numel() - over] if over > 0 else idx


def _divmod(x: torch.Tensor, chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk, offset) of flat positions: shifts for a power-of-two chunk (the default), far cheaper
    than int64 division on CPU."""
    if chunk_elems & (chunk_elems - 1) == 0:
        return x >> (chunk_elems.bit_length() - 1), x & (chunk_elems - 1)
    return x // chunk_elems, x % chunk_elems


def _check_pair(new: torch.Tensor, base: torch.Tensor) -> None:
    if new.dtype != base.dtype or new.shape != base.shape:
        raise LayoutMismatchError(
            f"delta base must match the new tensor: expected {tuple(new.shape)} {new.dtype}, "
            f"got {tuple(base.shape)} {base.dtype}"
        )


def _changed_positions(vals: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Sorted flat positions where two integer views differ: one compare pass and one nonzero."""
    return torch.nonzero(vals != old).reshape(-1)


def encode_delta(
    new: torch.Tensor, base: torch.Tensor, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS
) -> torch.Tensor:
    """Encode ``new`` as its byte changes against ``base``: a uint8 tensor on ``new``'s device.

    ``apply_delta_(base, encoded)`` then makes ``base`` bitwise equal to ``new``.

    Cost: one compare pass over both tensors and one ``nonzero``; everything after works on the
    changed positions (``k``) and the per-chunk table, not on full-size masks.
    """
    return encode_delta_with_positions(new, base, chunk_elems=chunk_elems)[0]


def encode_delta_with_positions(
    new: torch.Tensor, base: torch.Tensor, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS, advance: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`encode_delta` and the sorted flat int64 positions whose bytes changed (on ``new``'s
    device): what a sender needs to move its own base to ``new`` without decoding (``base_int[pos] =
    new_int[pos]``, see :func:`copy_changed_`). ``advance``: move ``base`` to ``new`` too (on CPU the
    native scan does it in its pass; otherwise :func:`copy_changed_` after the encode)."""
    vals, old = _int_views(new, base, chunk_elems)
    if vals.device.type == "cpu":
        out, pos_np, _, advanced = _encode_host(vals, old, base, chunk_elems, advance, positions=True)
        assert pos_np is not None
        pos = torch.from_numpy(pos_np)
    else:
        out, pos = _encode_torch(vals, old, chunk_elems, new.dtype.itemsize)
        advanced = False
    if advance and not advanced:
        copy_changed_(base, new, pos)
    return out, pos


def _encode_host(vals: torch.Tensor, old: torch.Tensor, base: torch.Tensor, chunk_elems: int, advance: bool,
                 positions: bool, arena: native.HostArena | None = None
                 ) -> tuple[torch.Tensor, np.ndarray | None, int, bool]:
    """:func:`~weight_sync.transport.delta_cpu.encode_cpu` of host integer views: (encoding, positions,
    changed count, whether the base was moved). The positions are there if asked, and whenever
    ``advance`` asked for a base move the encode did not make (the caller's :func:`copy_changed_`)."""
    in_place = advance and _base_in_place(old, base)
    out, pos, count, advanced = encode_cpu(vals.numpy(), old.numpy(), chunk_elems, vals.dtype.itemsize,
                                           advance=in_place, positions=positions or (advance and not in_place),
                                           arena=arena)
    return torch.from_numpy(out), pos, count, advanced


def _base_in_place(old: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether a scan may move ``base`` through its integer view ``old``: only where ``old`` is the base's
    own memory, not a copy of it."""
    return old.data_ptr() == base.data_ptr() and base.is_contiguous()


def _encode_counted(new: torch.Tensor, base: torch.Tensor, chunk_elems: int, advance: bool,
                    arena: native.HostArena | None) -> tuple[torch.Tensor, int]:
    """One host pair's encoding (in ``arena`` where given) and changed count (the base moved if
    ``advance``), without keeping the positions: the scan works in its thread's scratch buffers."""
    vals, old = _int_views(new, base, chunk_elems)
    out, pos, count, advanced = _encode_host(vals, old, base, chunk_elems, advance, positions=False, arena=arena)
    if advance and not advanced:
        # No native scan (or a base that is not one contiguous tensor): the positions were kept for this.
        assert pos is not None
        copy_changed_(base, new, torch.from_numpy(pos))
    return out, count


def encode_deltas(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], *, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
    advance: bool = False, arena: native.HostArena | None = None,
) -> list[tuple[torch.Tensor, int]]:
    """:func:`encode_delta` of several ``(new, base)`` pairs (the same bytes) with each one's count of
    changed elements. Pairs on a CUDA device are encoded together per item size with one device sync
    (``weight_sync.transport.delta_encode_group``); host pairs one by one (the native scan has no
    launches to save), on :func:`weight_sync.native.threads` threads, their encodings written into
    ``arena`` where one is given. ``advance``: every base is moved to its new tensor as well."""
    from weight_sync.transport.delta_encode_group import encode_group

    out: list[tuple[torch.Tensor, int] | None] = [None] * len(pairs)
    groups: dict[tuple[torch.device, int], list[int]] = {}
    host: list[int] = []
    for i, (new, _) in enumerate(pairs):
        if new.device.type == "cpu":
            host.append(i)
        else:
            groups.setdefault((new.device, new.dtype.itemsize), []).append(i)
    if host and native.enabled() and chunk_elems <= 1 << 16:
        host = _encode_batched(pairs, host, chunk_elems, advance, arena, out)
    # Host pairs on several threads (the scans run without the GIL), the largest first so that the
    # last to finish is a small one; each writes only its own base and encoding.
    host.sort(key=lambda i: -pairs[i][0].numel())
    read = 2 * sum(pairs[i][0].numel() * pairs[i][0].element_size() for i in host)  # both versions
    for i, done in zip(host, native.parallel_map(
            lambda i: _encode_counted(pairs[i][0], pairs[i][1], chunk_elems, advance, arena), host, read)):
        out[i] = done
    for at in groups.values():
        for i, done in zip(at, encode_group([pairs[i] for i in at], chunk_elems, advance=advance)):
            out[i] = done
    return [o for o in out if o is not None]


def _encode_batched(pairs: list[tuple[torch.Tensor, torch.Tensor]], host: list[int], chunk_elems: int, advance: bool,
                    arena: native.HostArena | None, out: list[tuple[torch.Tensor, int] | None]) -> list[int]:
    """Encode the host pairs the native batch takes (:func:`weight_sync.native.encode.encode_many`: a
    table row per tensor instead of a dozen numpy calls each) into ``out``; returns the others (a base
    that is not one contiguous tensor of its own, which the scan cannot move in place)."""
    from weight_sync.native.encode import encode_many

    views, batch, rest = [], [], []
    for i in host:
        new, base = pairs[i]
        vals, old = _int_views(new, base, chunk_elems)
        if advance and not _base_in_place(old, base):
            rest.append(i)
            continue
        views.append((vals, old))
        batch.append(i)
    for i, done in zip(batch, encode_many(views, chunk_elems, advance=advance, arena=arena)):
        out[i] = done
    return rest


def _int_views(new: torch.Tensor, base: torch.Tensor, chunk_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``new`` and ``base`` (moved to ``new``'s device) as flat integer views, once the arguments of an
    encoding are checked."""
    _check_chunk_elems(chunk_elems)
    _check_pair(new, base)
    return _as_int(new.detach().contiguous()), _as_int(base.detach().contiguous().to(new.device))


def _check_chunk_elems(chunk_elems: int) -> None:
    if chunk_elems < 8 or chunk_elems % 8 or chunk_elems >= 1 << 31:
        raise ConfigError(f"chunk_elems must be a positive multiple of 8 below 2**31, got {chunk_elems}")


def _encode_torch(vals: torch.Tensor, old: torch.Tensor, ce: int, item: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoding of integer views ``vals`` over ``old`` in torch operations, on their device (one
    tensor on CUDA; on CPU :func:`~weight_sync.transport.delta_cpu.encode_cpu` writes the same bytes,
    groups of CUDA tensors :func:`~weight_sync.transport.delta_encode_group.encode_group`)."""
    numel, dev = vals.numel(), vals.device
    num_chunks = -(-numel // ce)
    # One compare and one nonzero: comparing 8-byte words first (4 bf16 each) and splitting only
    # the changed words was measured too: faster at 0.5% density, slower from 2% on, so not kept.
    pos = _changed_positions(vals, old)  # sorted: element order
    # Changes per chunk from the sorted positions: a binary search per chunk boundary, no pass
    # over k. The per-chunk table is tiny (one entry per 64 Ki elements): decided on the host.
    bounds = torch.arange(num_chunks + 1, dtype=torch.int64, device=dev) * ce
    counts = torch.searchsorted(pos, bounds).diff().cpu()
    form = torch.from_numpy(_forms(counts.numpy(), ce, numel, item))
    is_bm, is_ix, is_pl = form == FORM_BITMASK, form == FORM_INDEX, form == FORM_PLAIN
    n_bm, n_ix, n_pl = int(is_bm.sum()), int(is_ix.sum()), int(is_pl.sum())
    empty8 = torch.empty(0, dtype=torch.uint8, device=dev)
    bitmask, offsets, sparse_vals, plain_vals = empty8, empty8, empty8, empty8
    if n_pl == num_chunks:
        plain_vals = vals.view(torch.uint8)  # every chunk plain: the tensor itself
    elif pos.numel():
        # Per changed element its chunk's form, unless one form covers every chunk.
        # Repeated on the device from the per-chunk table (a host repeat would move 8 bytes per change).
        elem_form = None if num_chunks in (n_bm, n_ix) else torch.repeat_interleave(
            to_device(form, dev), to_device(counts, dev), output_size=pos.numel())

        def pick(kind: int) -> torch.Tensor:
            if elem_form is None:
                return pos
            size = int(counts[form == kind].sum())  # known on the host: no sync for the selection
            return pos[torch.nonzero_static(elem_form == kind, size=size).reshape(-1)]

        # Values of the bitmask chunks first, then of the index chunks: each group decodes to its
        # positions in element order, so the engine writes both without sorting.
        vals_parts = []
        if n_bm:
            sel_b = pick(FORM_BITMASK)
            c, within = _divmod(sel_b, ce)
            # Bit position inside the concatenated bitmasks: the chunk's rank among bitmask chunks.
            rank = to_device(torch.cumsum(is_bm, 0) - 1, dev)
            bitpos = rank[c] * ce + within
            bitmask = torch.zeros(n_bm * ce // 8, dtype=torch.uint8, device=dev)
            # Distinct bits of a byte: their sum is their OR.
            bitmask.index_put_((bitpos >> 3,), _bits(dev)[bitpos & 7], accumulate=True)
            vals_parts.append(vals[sel_b])
        if n_ix:
            sel = pick(FORM_INDEX)
            offsets = _pack_offsets(_divmod(sel, ce)[1], ce).view(torch.uint8)
            vals_parts.append(vals[sel])
        if vals_parts:
            sparse_vals = (vals_parts[0] if len(vals_parts) == 1 else torch.cat(vals_parts)).view(torch.uint8)
        if n_pl:
            plain_vals = vals[_plain_positions(is_pl.nonzero().reshape(-1), ce, numel, dev)].view(torch.uint8)

    table = torch.stack([form, counts], 1).to(torch.int32).reshape(-1)
    header = torch.tensor([MAGIC, ce, num_chunks, item], dtype=torch.int32)
    head = to_device(torch.cat([header, table]).view(torch.uint8), dev)
    parts = [head, bitmask, offsets, sparse_vals, plain_vals]
    total = sum(_align8(p.numel()) for p in parts)
    out = torch.empty(total, dtype=torch.uint8, device=dev)
    pos_out = 0
    for part in parts:
        n = part.numel()
        out[pos_out : pos_out + n] = part
        padded = _align8(n)
        if padded > n:
            out[pos_out + n : pos_out + padded] = 0
        pos_out += padded
    return out, pos


def copy_changed_(base: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> None:
    """Write ``new``'s elements at flat ``positions`` into ``base`` (same dtype and shape; the bytes)."""
    _check_pair(new, base)
    if not base.is_contiguous():
        raise LayoutMismatchError(f"delta base must be contiguous, got strides {base.stride()}")
    dst, src = _as_int(base.detach()), _as_int(new.detach().contiguous())
    if dst.device.type == "cpu" and src.device.type == "cpu":
        p = positions.numpy()
        dst.numpy()[p] = src.numpy()[p]
        return
    dst[positions.to(dst.device)] = src[positions.to(src.device)].to(dst.device)


# Not frozen: a frozen dataclass's __init__ costs ~1 us more per instance, and a bucket parses hundreds.
@dataclass(eq=False)
class _Parsed:
    chunk_elems: int
    num_chunks: int
    # int64 per chunk, on the host (the table is read there anyway): numpy arrays, whose slicing and
    # small reductions cost a fraction of a torch call's overhead (a bucket parses hundreds of these).
    form: np.ndarray
    counts: np.ndarray
    regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # bitmask, offsets, sparse, plain
    payload: torch.Tensor | None = None  # the encoding itself (its table, read in place: table)
    # From the table, on the host: plain chunks, and the changes in bitmask and in index chunks (a
    # batch decoder groups payloads by these without a torch call per tensor).
    n_plain_chunks: int = 0
    n_bits: int = 0
    n_index: int = 0

    @functools.cached_property
    def table(self) -> torch.Tensor | None:
        """The chunk table read in place on the payload's device, int64 (num_chunks, 2), made once; None
        where the payload's bytes are not 4-byte aligned. Device decoders take their chunk lists from
        it: a host list would be one more (pageable, so blocking) copy to the device per tensor."""
        return None if self.payload is None else _device_table(self.payload, self.num_chunks)

    def chunks(self, kind: int, dev: torch.device) -> torch.Tensor:
        """The chunk numbers of form ``kind``, ascending, on ``dev`` (no device sync)."""
        host = self.form == kind
        if self.table is None:
            return to_device(torch.from_numpy(np.flatnonzero(host)), dev)
        return torch.nonzero_static(self.table[:, 0] == kind, size=int(host.sum())).reshape(-1)

    def chunk_counts(self, chunks: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """The changed counts of ``chunks`` (from :meth:`chunks`), on ``dev``."""
        if self.table is None:
            return to_device(torch.from_numpy(self.counts[chunks.cpu().numpy()]), dev)
        return self.table[:, 1][chunks]


def _device_table(payload: torch.Tensor, num_chunks: int) -> torch.Tensor | None:
    """The chunk table of ``payload`` as int64 (num_chunks, 2) on its device, read in place."""
    if payload.storage_offset() % 4:
        return None
    return payload[16 : 16 + 8 * num_chunks].view(torch.int32).view(num_chunks, 2).long()


def head_bytes(numel: int) -> int:
    """How many leading bytes of a tensor's encoding :func:`_parse` reads on the host: the header and,
    at the default chunk size, the whole chunk table (what :func:`read_heads` fetches ahead)."""
    return 16 + 8 * -(-numel // DEFAULT_CHUNK_ELEMS)


def read_heads(items: list[tuple[torch.Tensor, int]]) -> list[np.ndarray]:
    """The leading bytes (:func:`head_bytes`) of several encodings ``(payload, numel)`` that live on one
    device, read to the host together: one device sync for a bucket instead of one per tensor."""
    parts = [payload[: min(head_bytes(numel), payload.numel())] for payload, numel in items]
    if not parts:
        return []
    flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
    out, at = [], 0
    for part in parts:
        out.append(flat[at : at + part.numel()])
        at += part.numel()
    return out


def _parse(payload: torch.Tensor, numel: int, dtype: torch.dtype, head: np.ndarray | None = None) -> _Parsed:
    """Split an encoding into its regions, checking it against the tensor it claims to describe.

    ``head``: its leading bytes already on the host (:func:`read_heads`), which saves this read.
    """
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < 16:
        raise LayoutMismatchError(
            f"delta payload must be a 1-D uint8 tensor of at least 16 bytes, got {tuple(payload.shape)} {payload.dtype}"
        )
    # The header and table are the only host reads: a few bytes per chunk, in one read (one device
    # sync on CUDA) when the encoding uses the default chunk size, else two.
    # Read through numpy: a handful of small-array operations per tensor, each far cheaper than
    # torch's per-call overhead (this runs for every tensor of every delta).
    if head is None:
        head = payload[: min(head_bytes(numel), payload.numel())].cpu().numpy()
    if head.size < 16:
        raise LayoutMismatchError(f"delta payload: {head.size} header bytes, expected at least 16")
    magic, chunk_elems, num_chunks, item = head[:16].view(np.int32).tolist()
    item_want = dtype.itemsize
    if magic != MAGIC or item != item_want or chunk_elems < 8 or num_chunks != -(-numel // chunk_elems):
        raise LayoutMismatchError(
            f"delta payload header: expected magic {MAGIC:#x}, item size {item_want}, chunks for {numel} "
            f"elements; got magic {magic:#x}, item size {item}, {num_chunks} chunks of {chunk_elems}"
        )
    pos = 16
    table_bytes = num_chunks * 8
    if payload.numel() < pos + table_bytes:
        raise LayoutMismatchError(f"delta payload: {payload.numel()} bytes cannot hold a table of {num_chunks} chunks")
    raw = head[pos : pos + table_bytes] if head.size >= pos + table_bytes else payload[pos : pos + table_bytes].cpu().numpy()
    # Rows (forms, counts), each contiguous: the torch views below need no copy.
    table = raw.view(np.int32).reshape(num_chunks, 2).T.astype(np.int64, order="C")
    pos += _align8(table_bytes)
    form_np, counts_np = table[0], table[1]
    # One comparison for both bounds: a negative form reads as a large unsigned one.
    if num_chunks and bool((form_np.view(np.uint64) > FORM_PLAIN).any()):
        raise LayoutMismatchError(f"delta payload: a chunk form outside {FORM_SAME}..{FORM_PLAIN} in its table")
    # Chunks and changes per form in two passes (this runs for every tensor of every delta).
    chunks_of = np.bincount(form_np, minlength=4).tolist()
    changes_of = np.bincount(form_np, weights=counts_np, minlength=4).tolist()
    n_bitmask = chunks_of[FORM_BITMASK]
    n_index_vals = int(changes_of[FORM_INDEX])
    n_bits = int(changes_of[FORM_BITMASK])
    n_plain = chunks_of[FORM_PLAIN] * chunk_elems
    if num_chunks and int(form_np[-1]) == FORM_PLAIN:
        n_plain -= num_chunks * chunk_elems - numel  # the last chunk is short
    lengths = (n_bitmask * (chunk_elems // 8), n_index_vals * _offset_bytes(chunk_elems),
                  (n_bits + n_index_vals) * item, n_plain * item)
    regions = []
    for n in lengths:
        regions.append(payload[pos : pos + n])
        pos += _align8(n)
    if pos != payload.numel() or min(lengths) < 0:
        raise LayoutMismatchError(f"delta payload: the table describes {pos} bytes, the payload has {payload.numel()}")
    int_dtype = _INT_OF_SIZE[item] if dtype != torch.bool else torch.uint8
    bitmask, offsets, sparse, plain = regions
    return _Parsed(chunk_elems, num_chunks, form_np, counts_np,
                   (bitmask, offsets, sparse.view(int_dtype), plain.view(int_dtype)), payload,
                   chunks_of[FORM_PLAIN], n_bits, n_index_vals)


def delta_stats(payload: torch.Tensor, numel: int, dtype: torch.dtype) -> DeltaStats:
    """Describe an encoding of a tensor of ``numel`` elements of ``dtype`` (plain chunks count as changed)."""
    p = _parse(payload, numel, dtype)
    f = p.form
    per_form = tuple(int((f == k).sum()) for k in (FORM_SAME, FORM_BITMASK, FORM_INDEX, FORM_PLAIN))
    changed = int(p.counts[f != FORM_PLAIN].sum()) + p.regions[3].numel()
    return DeltaStats(numel, changed, per_form, payload.numel(), numel * dtype.itemsize)  # type: ignore[arg-type]


#: Checks of a decoded payload still on the device: (a 0-dim bool tensor, True where the payload is
#: bad; the message naming what is wrong). See :func:`raise_failed`.
Checks = list[tuple[torch.Tensor, str]]


def raise_failed(checks: Checks) -> None:
    """Read deferred decode checks back (one device sync for all of them) and raise on the first failed."""
    if checks:
        for failed, (_, message) in zip(torch.stack([c for c, _ in checks]).tolist(), checks):
            if failed:
                raise LayoutMismatchError(f"delta payload: {message}")


def _sparse_positions(p: _Parsed, numel: int, dev: torch.device, checks: Checks | None = None,
                      arena: native.HostArena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions of the bitmask chunks' changes and of the index chunks' changes, each in element
    order (the order of their values in the sparse region), checked against the region and the tensor
    (on the device, the checks go to ``checks`` when given, for the caller to read back before any write;
    on the host, the positions go into ``arena`` when given)."""
    if dev.type == "cpu":
        return sparse_positions_cpu(p, numel, arena)
    return _sparse_positions_torch(p, numel, dev, checks)


def _sparse_positions_torch(p: _Parsed, numel: int, dev: torch.device,
                            deferred: Checks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sparse_positions` in torch operations on ``dev`` (CUDA; the CPU path decodes the same
    positions in numpy). No device sync while ``deferred`` takes the checks."""
    ce = p.chunk_elems
    bitmask, offsets, sparse, _ = p.regions
    bpos = ipos = torch.empty(0, dtype=torch.int64, device=dev)
    checks: Checks = []
    if bitmask.numel():
        is_bm = p.form == FORM_BITMASK
        bm_chunks = p.chunks(FORM_BITMASK, dev)
        # Every bit unpacked: bitmask chunks are dense (index wins below 1/16 of a chunk changed), so
        # splitting only the nonzero bytes was measured slower (18.9 vs 16.3 ms, 4 Mi). The table says
        # how many bits are set: a static-size nonzero needs no device sync, and a bitmask whose count
        # differs from its table is refused below.
        bits = ((bitmask.view(-1, 1) & _bits(dev)) != 0).view(-1)
        want = int(p.counts[is_bm].sum())
        hit = torch.nonzero_static(bits, size=want).reshape(-1)
        checks.append((bits.sum() != want, f"the bitmasks hold a different number of changes than the table's {want}"))
        c, within = _divmod(hit, ce)
        bpos = bm_chunks[c.clamp_(min=0)] * ce + within
    if offsets.numel():
        chunks = p.chunks(FORM_INDEX, dev)
        off = _unpack_offsets(offsets, ce)
        if ce < 1 << 16:  # int16 offsets cannot exceed a 64 Ki chunk (the default size): nothing to check there
            checks.append(((off >= ce).any(), f"an index offset is outside its chunk of {ce} elements"))
        # Each offset's chunk, repeated on the device from the table (the region holds one offset per
        # change the table counts for its index chunks).
        ipos = torch.repeat_interleave(chunks, p.chunk_counts(chunks, dev), output_size=off.numel()) * ce + off
        # Offsets must increase inside a chunk (a repeat would write one element twice).
        if ipos.numel() > 1:
            checks.append(((ipos[1:] <= ipos[:-1]).any(), "index offsets repeat or are out of order"))
    if bpos.numel() + ipos.numel() != sparse.numel():
        raise LayoutMismatchError(
            f"delta payload: {bpos.numel() + ipos.numel()} changed positions but {sparse.numel()} values"
        )
    checks += [(part[-1] >= numel, f"a changed position lies beyond the tensor's {numel} elements")
               for part in (bpos, ipos) if part.numel()]
    if deferred is not None:
        deferred += checks
    else:
        raise_failed(checks)
    return bpos, ipos


def decode_delta(payload: torch.Tensor, numel: int, dtype: torch.dtype, *, head: np.ndarray | None = None,
                 checks: Checks | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The changes an encoding carries, without a base: (flat int64 positions, their new values as
    integers of the item size), on the payload's device, checked like :func:`apply_delta_`.

    ``head``: the payload's leading bytes read ahead (:func:`read_heads`). ``checks``: a list that takes
    the checks a CUDA decode would otherwise read back at once (one device sync per tensor); the caller
    must then :func:`raise_failed` them before writing anything decoded. On CPU every check runs here.

    The positions are distinct but not sorted (bitmask chunks', then index chunks', then plain chunks'
    elements, each group in element order); plain chunks list every element, changed or not. Writing
    ``values`` at ``positions`` into the base gives the new tensor: what an engine that applies deltas
    in place (``weight_sync.reload.delta_apply``) does, into live storage or a model-format copy.
    """
    return decode_parsed(_parse(payload, numel, dtype, head), numel, payload.device, checks)


def decode_parsed(p: _Parsed, numel: int, dev: torch.device, checks: Checks | None = None,
                  arena: native.HostArena | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_delta` of a payload already parsed (``_parse``), on ``dev`` (host positions written
    into ``arena`` where one is given)."""
    sparse, plain = p.regions[2], p.regions[3]
    bpos, ipos = _sparse_positions(p, numel, dev, checks, arena)
    if not plain.numel():
        return (bpos if not ipos.numel() else ipos if not bpos.numel() else torch.cat([bpos, ipos])), sparse
    plain_pos = _plain_positions(_plain_chunks(p), p.chunk_elems, numel, dev,
                                 None if dev.type == "cpu" else p.chunks(FORM_PLAIN, dev))
    if not sparse.numel():
        return plain_pos, plain
    return torch.cat([bpos, ipos, plain_pos]), torch.cat([sparse, plain])


def _plain_chunks(p: _Parsed) -> torch.Tensor:
    """The numbers of ``p``'s plain chunks, ascending (a host int64 tensor)."""
    return torch.from_numpy(np.flatnonzero(p.form == FORM_PLAIN))


def apply_delta_(base: torch.Tensor, payload: torch.Tensor, *, positions: bool = True) -> torch.Tensor | None:
    """Write an encoding into ``base`` in place; returns the flat int64 positions whose bytes changed
    (``None`` with ``positions=False``: the decode alone, no sort of the positions).

    The positions are exact (plain chunks are compared against the old bytes before they are
    overwritten), sorted, on ``base``'s device: what a requantization needs to know. Everything is
    checked before the first write: a malformed payload leaves ``base`` untouched.
    """
    if not base.is_contiguous():
        raise LayoutMismatchError(f"delta base must be contiguous, got strides {base.stride()}")
    flat = _as_int(base)
    numel, dev = flat.numel(), flat.device
    payload = payload.to(dev)
    p = _parse(payload, numel, base.dtype)
    sparse, plain = p.regions[2], p.regions[3]
    bpos, ipos = _sparse_positions(p, numel, dev)
    if plain.numel() == numel:  # every chunk plain
        changed = torch.nonzero(flat != plain).reshape(-1) if positions else None
        flat.copy_(plain)
        return changed
    if bpos.numel():
        flat[bpos] = sparse[: bpos.numel()]
    if ipos.numel():
        flat[ipos] = sparse[bpos.numel() :]
    found = [bpos, ipos]
    if plain.numel():
        # Plain and sparse chunks are disjoint: the order of the writes does not matter.
        plain_pos = _plain_positions(_plain_chunks(p), p.chunk_elems, numel, dev)
        if positions:
            found.append(plain_pos[flat[plain_pos] != plain])
        flat[plain_pos] = plain
    if not positions:
        return None
    found = [f for f in found if f.numel()]
    if not found:
        return bpos
    return found[0] if len(found) == 1 else torch.cat(found).sort().values
