"""Delta encoding: a tensor as the exact byte changes against its base version, decoded in place.

Change detection compares *bytes*, never values: both tensors are viewed as integers of their item size,
so ``-0.0`` vs ``0.0`` and two NaNs with different payloads count as changes and an unchanged NaN does
not. There is no tolerance: applying the encoding to the base gives the new tensor bit for bit.

A tensor's flat elements are cut into chunks of ``chunk_elems`` (a multiple of 8). Each chunk picks the
smallest of four forms, from its element count ``n``, its changed count ``k`` and the item size ``s``:

- *same*: nothing changed (0 bytes beyond the table entry);
- *bitmask*: ``chunk_elems / 8`` bytes of change bits + the ``k`` new values (``k * s``);
- *index*: ``k`` int32 offsets inside the chunk + the ``k`` new values (``4k + k * s``);
- *plain*: all ``n`` new values (``n * s``): chosen whenever the encoding would not be smaller.

Wire layout (one uint8 tensor, self-describing; every region starts on an 8-byte boundary)::

    int32[4]   magic, chunk_elems, num_chunks, item size
    int32[2c]  (form, k) per chunk
    uint8[]    bitmasks of the bitmask chunks, chunk order (chunk_elems / 8 bytes each)
    int32[]    offsets of the index chunks, chunk order
    item[]     new values of the changed elements of bitmask and index chunks, in element order
    item[]     every value of the plain chunks, chunk order

Grouping the regions by form (instead of chunk by chunk) makes both directions a handful of vectorized
tensor operations whatever the number of chunks: no Python loop over chunks, the same code on CPU and
CUDA. Limitations: tensors of up to 2**31 - 1 elements per chunk offset (offsets are int32, chunks are
smaller), dtypes of item size 1, 2, 4 or 8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weight_sync.errors import ConfigError, LayoutMismatchError

__all__ = [
    "DEFAULT_CHUNK_ELEMS",
    "FORM_BITMASK",
    "FORM_INDEX",
    "FORM_PLAIN",
    "FORM_SAME",
    "DeltaStats",
    "apply_delta_",
    "changed_mask",
    "delta_stats",
    "encode_delta",
]

MAGIC = 0x31445357  # "WSD1" little-endian
FORM_SAME, FORM_BITMASK, FORM_INDEX, FORM_PLAIN = 0, 1, 2, 3
# 64 Ki elements: a bitmask chunk costs 8 KiB of bits, so a chunk with more than ~2k changes (3%) of
# bf16 prefers the bitmask; small enough that a dense corner of a tensor goes plain on its own.
DEFAULT_CHUNK_ELEMS = 1 << 16
_HEADER_INTS = 4
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


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
    if new.dtype != base.dtype or new.shape != base.shape:
        raise LayoutMismatchError(
            f"delta base must match the new tensor: expected {tuple(new.shape)} {new.dtype}, "
            f"got {tuple(base.shape)} {base.dtype}"
        )
    return _as_int(new.contiguous()) != _as_int(base.contiguous().to(new.device))


@dataclass(frozen=True, slots=True)
class DeltaStats:
    """What an encoding holds: elements, changed elements, chunks per form, its size and the plain size."""

    numel: int
    num_changed: int
    chunks: tuple[int, int, int, int]  # same, bitmask, index, plain
    nbytes: int
    plain_nbytes: int


def _forms(counts: torch.Tensor, sizes: torch.Tensor, chunk_elems: int, item: int) -> torch.Tensor:
    """Per chunk the cheapest form (ties go to the simpler one: same < plain < index < bitmask)."""
    bitmask = chunk_elems // 8 + counts * item
    index = counts * (4 + item)
    plain = sizes * item
    form = torch.full_like(counts, FORM_PLAIN)
    form = torch.where(index < plain, torch.full_like(counts, FORM_INDEX), form)
    best = torch.minimum(index, plain)
    form = torch.where(bitmask < best, torch.full_like(counts, FORM_BITMASK), form)
    return torch.where(counts == 0, torch.full_like(counts, FORM_SAME), form)


def encode_delta(
    new: torch.Tensor, base: torch.Tensor, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS
) -> torch.Tensor:
    """Encode ``new`` as its byte changes against ``base``: a uint8 tensor on ``new``'s device.

    ``apply_delta_(base, encoded)`` then makes ``base`` bitwise equal to ``new``.
    """
    if chunk_elems < 8 or chunk_elems % 8 or chunk_elems >= 1 << 31:
        raise ConfigError(f"chunk_elems must be a positive multiple of 8 below 2**31, got {chunk_elems}")
    mask = changed_mask(new, base)
    vals = _as_int(new.contiguous())
    numel, item, dev = vals.numel(), new.dtype.itemsize, vals.device
    num_chunks = -(-numel // chunk_elems)
    padded = torch.zeros(num_chunks * chunk_elems, dtype=torch.bool, device=dev)
    padded[:numel] = mask
    grid = padded.view(num_chunks, chunk_elems)
    counts = grid.sum(1, dtype=torch.int64)
    sizes = torch.full((num_chunks,), chunk_elems, dtype=torch.int64, device=dev)
    if num_chunks:
        sizes[-1] = numel - (num_chunks - 1) * chunk_elems
    form = _forms(counts, sizes, chunk_elems, item)
    elem_form = form.repeat_interleave(chunk_elems)[:numel]

    bits = grid[form == FORM_BITMASK].view(-1, chunk_elems // 8, 8).to(torch.uint8)
    bitmask = (bits * _BITS.to(dev)).sum(2, dtype=torch.uint8).reshape(-1)
    index_pos = torch.nonzero(mask & (elem_form == FORM_INDEX)).reshape(-1)
    offsets = (index_pos % chunk_elems).to(torch.int32)
    sparse_vals = vals[mask & ((elem_form == FORM_BITMASK) | (elem_form == FORM_INDEX))]
    plain_vals = vals[elem_form == FORM_PLAIN]

    table = torch.stack([form, counts], 1).to(torch.int32).reshape(-1)
    header = torch.tensor([MAGIC, chunk_elems, num_chunks, item], dtype=torch.int32, device=dev)
    parts = [header.view(torch.uint8), table.view(torch.uint8), bitmask, offsets.view(torch.uint8),
             sparse_vals.view(torch.uint8), plain_vals.view(torch.uint8)]
    total = sum(_align8(p.numel()) for p in parts)
    out = torch.zeros(total, dtype=torch.uint8, device=dev)
    pos = 0
    for p in parts:
        out[pos : pos + p.numel()] = p
        pos += _align8(p.numel())
    return out


@dataclass(frozen=True, slots=True)
class _Parsed:
    chunk_elems: int
    num_chunks: int
    form: torch.Tensor  # int64 per chunk, on the payload's device
    counts: torch.Tensor
    regions: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # bitmask, offsets, sparse, plain


def _parse(payload: torch.Tensor, numel: int, dtype: torch.dtype) -> _Parsed:
    """Split an encoding into its regions, checking it against the tensor it claims to describe."""
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < 16:
        raise LayoutMismatchError(
            f"delta payload must be a 1-D uint8 tensor of at least 16 bytes, got {tuple(payload.shape)} {payload.dtype}"
        )
    # The header and table are the only host reads: a few bytes per chunk.
    magic, chunk_elems, num_chunks, item = (int(x) for x in payload[:16].view(torch.int32).tolist())
    item_want = dtype.itemsize
    if magic != MAGIC or item != item_want or num_chunks != -(-numel // max(chunk_elems, 1)):
        raise LayoutMismatchError(
            f"delta payload header: expected magic {MAGIC:#x}, item size {item_want}, chunks for {numel} "
            f"elements; got magic {magic:#x}, item size {item}, {num_chunks} chunks of {chunk_elems}"
        )
    pos = 16
    table_bytes = num_chunks * 8
    table = payload[pos : pos + table_bytes].view(torch.int32).view(num_chunks, 2).to(torch.int64)
    pos += _align8(table_bytes)
    form, counts = table[:, 0], table[:, 1]
    host = torch.stack([form, counts]).cpu()
    f_h, c_h = host[0], host[1]
    n_bitmask = int((f_h == FORM_BITMASK).sum())
    n_index_vals = int(c_h[f_h == FORM_INDEX].sum())
    n_sparse = int(c_h[(f_h == FORM_BITMASK) | (f_h == FORM_INDEX)].sum())
    plain_chunks = (f_h == FORM_PLAIN).nonzero().reshape(-1)
    n_plain = sum(min(chunk_elems, numel - int(c) * chunk_elems) for c in plain_chunks)
    lengths = (n_bitmask * (chunk_elems // 8), n_index_vals * 4, n_sparse * item, n_plain * item)
    regions = []
    for n in lengths:
        regions.append(payload[pos : pos + n])
        pos += _align8(n)
    if pos != payload.numel():
        raise LayoutMismatchError(f"delta payload: the table describes {pos} bytes, the payload has {payload.numel()}")
    int_dtype = _INT_OF_SIZE[item] if dtype != torch.bool else torch.uint8
    bitmask, offsets, sparse, plain = regions
    return _Parsed(chunk_elems, num_chunks, form, counts,
                   (bitmask, offsets.view(torch.int32), sparse.view(int_dtype), plain.view(int_dtype)))


def delta_stats(payload: torch.Tensor, numel: int, dtype: torch.dtype) -> DeltaStats:
    """Describe an encoding of a tensor of ``numel`` elements of ``dtype`` (plain chunks count as changed)."""
    p = _parse(payload, numel, dtype)
    f = p.form.cpu()
    per_form = tuple(int((f == k).sum()) for k in (FORM_SAME, FORM_BITMASK, FORM_INDEX, FORM_PLAIN))
    changed = int(p.counts.cpu()[f != FORM_PLAIN].sum()) + p.regions[3].numel()
    return DeltaStats(numel, changed, per_form, payload.numel(), numel * dtype.itemsize)  # type: ignore[arg-type]


def apply_delta_(base: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """Write an encoding into ``base`` in place; returns the flat int64 positions whose bytes changed.

    The positions are exact (plain chunks are compared against the old bytes before they are
    overwritten), sorted, on ``base``'s device: what a requantization needs to know.
    """
    if not base.is_contiguous():
        raise LayoutMismatchError(f"delta base must be contiguous, got strides {base.stride()}")
    flat = _as_int(base)
    numel, dev = flat.numel(), flat.device
    p = _parse(payload.to(dev), numel, base.dtype)
    ce = p.chunk_elems
    bitmask, offsets, sparse, plain = p.regions
    sparse_mask = torch.zeros(p.num_chunks * ce, dtype=torch.bool, device=dev)
    grid = sparse_mask.view(p.num_chunks, ce)
    is_bitmask = p.form == FORM_BITMASK
    if bitmask.numel():
        bits = (bitmask.view(-1, ce // 8, 1) & _BITS.to(dev)) != 0
        grid[is_bitmask] = bits.view(-1, ce)
    is_index = p.form == FORM_INDEX
    if offsets.numel():
        chunk_of = torch.nonzero(is_index).reshape(-1).repeat_interleave(p.counts[is_index])
        sparse_mask[chunk_of * ce + offsets.to(torch.int64)] = True
    sparse_mask = sparse_mask[:numel]
    if int(sparse_mask.sum()) != sparse.numel():
        raise LayoutMismatchError(
            f"delta payload: {int(sparse_mask.sum())} changed positions but {sparse.numel()} values"
        )
    plain_mask = (p.form == FORM_PLAIN).repeat_interleave(ce)[:numel]
    plain_changed = torch.zeros_like(sparse_mask)
    if plain.numel():
        plain_changed[plain_mask] = flat[plain_mask] != plain
        flat[plain_mask] = plain
    flat[sparse_mask] = sparse
    return torch.nonzero(sparse_mask | plain_changed).reshape(-1)
