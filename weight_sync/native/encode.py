"""A sender's host delta encodings made in batches by the native kernels (``encode.c``).

Encoding tensor by tensor costs a dozen numpy calls and a GIL hand-back per tensor (~120 us): for the
310 tensors of a 0.6B model more than a quarter of the encode on two cores, and the whole of the gap to
the compare bound on a 16-core host. Here the tensors are described by two tables and the kernels run
over runs of rows, the GIL released:

1. **Scan.** Tensors are cut into ranges of whole chunks (at most :data:`RANGE_ELEMS` elements, so the
   threads share even work even where one tensor, an embedding, holds a quarter of the model). Each
   range's changes (16-bit offsets and values) go into its own scratch, sized for about 3% changed; a
   denser range stops at a chunk boundary and its rest is scanned again as a range of its own, with
   room for every element.
2. **Sizes.** One call decides every chunk's form and every encoding's region sizes.
3. **Write.** Every encoding is laid out from its ranges' scratch into one slice of the arena.

The bytes are those of :func:`weight_sync.transport.delta_cpu.encode_cpu` (the tests compare them).
"""

from __future__ import annotations

import numpy as np
import torch

from weight_sync.errors import LayoutMismatchError
from weight_sync.native import HostArena, _need, _spans, library, parallel_map, threads

__all__ = ["RANGE_ELEMS", "encode_many"]

#: Elements per scan range (rounded down to whole chunks): 16 MB of bf16, ~75 ranges for a 0.6B model.
RANGE_ELEMS = 1 << 23

# Table columns, as encode.c names them (R_*, T_*).
_R_COLS, _R_N, _R_CAP, _R_DONE = 12, 2, 9, 11
_T_COLS, _T_SIZE, _T_K, _T_OUT = 16, 9, 10, 8
_SLACK = 64  # entries past a scratch's capacity the vector scans may store into
_ALIGN = 64


def _aligned(nbytes: np.ndarray) -> np.ndarray:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


def _run(kernel: str, table: np.ndarray, work: np.ndarray, work_bytes: int, *extra: int) -> None:
    """``kernel(table, *extra, lo, hi)`` over runs of the table's rows, on the native threads."""
    fn = getattr(_need(library()), kernel)
    parallel_map(lambda s: fn(table.ctypes.data, *extra, s[0], s[1]), _spans(work, 4 * threads()), work_bytes)


def _scratch_rows(rows: np.ndarray, items: np.ndarray, arena: HostArena | None) -> list[np.ndarray]:
    """Give each range row its offsets' and values' scratch (room for its capacity and the slack) from
    one buffer; returns what the rows point into, to be kept alive while they are used."""
    cap = rows[:, _R_CAP] + _SLACK
    off_bytes, val_bytes = _aligned(2 * cap), _aligned(cap * items)
    at = np.concatenate([[0], np.cumsum(off_bytes + val_bytes)])
    total = int(at[-1])
    buf = np.empty(total, np.uint8) if arena is None else arena.take(total, np.uint8)
    rows[:, 6] = buf.ctypes.data + at[:-1]
    rows[:, 7] = rows[:, 6] + off_bytes
    return [buf]


def encode_many(pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk: int, *, advance: bool,
                arena: HostArena | None = None) -> list[tuple[torch.Tensor, int]]:
    """The delta encoding of every ``(new, base)`` pair and its changed count, in order: flat contiguous
    CPU integer views of one item size per pair (1, 2, 4 or 8 bytes), chunks of at most 64 Ki elements.
    ``advance``: every base is moved to its new tensor as it is scanned (each base must not share
    memory with another pair's). Encodings, and the scans' scratch, are taken from ``arena`` where one is
    given (valid until its reset)."""
    if not pairs:
        return []
    if chunk > 1 << 16 or chunk < 8 or chunk % 8:
        raise LayoutMismatchError(f"batched delta encode: chunks of 8..65536 elements in multiples of 8, got {chunk}")
    for new, base in pairs:
        if (new.dtype != base.dtype or new.numel() != base.numel() or new.element_size() not in (1, 2, 4, 8)
                or not (new.is_cpu and base.is_cpu and new.is_contiguous() and base.is_contiguous())):
            raise LayoutMismatchError(
                f"batched delta encode: expected flat contiguous CPU views of one 1, 2, 4 or 8-byte dtype, got "
                f"{new.dtype} {tuple(new.shape)} over {base.dtype} {tuple(base.shape)} ({new.device}, {base.device})")
    numel = np.array([new.numel() for new, _ in pairs], dtype=np.int64)
    item = np.array([new.element_size() for new, _ in pairs], dtype=np.int64)
    new_at = np.array([new.data_ptr() for new, _ in pairs], dtype=np.int64)
    base_at = np.array([base.data_ptr() for _, base in pairs], dtype=np.int64)
    nchunks = -(-numel // chunk)
    first_chunk = np.concatenate([[0], np.cumsum(nchunks)])
    counts = np.zeros(int(first_chunk[-1]) + 1, dtype=np.int64)  # one spare: a tensor of no chunks points past
    forms = np.zeros_like(counts)

    # Ranges: whole chunks, at most `per` elements each.
    per = max(chunk, RANGE_ELEMS // chunk * chunk)
    nranges = -(-numel // per)
    owner = np.repeat(np.arange(len(pairs)), nranges)
    range0 = np.concatenate([[0], np.cumsum(nranges)])
    lo = (np.arange(owner.size) - range0[owner]) * per
    n = np.minimum(per, numel[owner] - lo)
    rows = np.zeros((owner.size, _R_COLS), dtype=np.int64)
    rows[:, 0] = new_at[owner] + lo * item[owner]
    rows[:, 1] = base_at[owner] + lo * item[owner]
    rows[:, _R_N], rows[:, 3], rows[:, 4], rows[:, 5] = n, item[owner], chunk, int(advance)
    rows[:, 8] = counts.ctypes.data + 8 * (first_chunk[owner] + lo // chunk)
    rows[:, _R_CAP] = np.minimum(n, n // 32 + chunk)  # ~3% changed; the scan needs room for a whole chunk
    keep = _scratch_rows(rows, item[owner], arena)
    read = 2 * int((numel * item).sum())  # both versions
    _run("ws_scan_ranges", rows, n * item[owner], read)

    # Ranges that ran out of scratch continue, from where they stopped, as ranges with room for every
    # element; each is placed right after the part scanned, which is what the layout walks.
    short = np.flatnonzero(rows[:, _R_DONE] * chunk < rows[:, _R_N])
    if short.size:
        rest = rows[short].copy()
        done = rows[short, _R_DONE] * chunk
        rows[short, _R_N] = done
        rest[:, 0] += done * rest[:, 3]
        rest[:, 1] += done * rest[:, 3]
        rest[:, _R_N] -= done
        rest[:, 8] += 8 * rows[short, _R_DONE]
        rest[:, _R_CAP] = rest[:, _R_N]
        keep += _scratch_rows(rest, rest[:, 3], arena)
        _run("ws_scan_ranges", rest, rest[:, _R_N] * rest[:, 3], 2 * int((rest[:, _R_N] * rest[:, 3]).sum()))
        rows = np.insert(rows, short + 1, rest, axis=0)
        owner = np.insert(owner, short + 1, owner[short])
        range0 = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(pairs)))])

    tensors = np.zeros((len(pairs), _T_COLS), dtype=np.int64)
    tensors[:, 0], tensors[:, 1], tensors[:, 2], tensors[:, 3] = new_at, numel, item, chunk
    tensors[:, 4] = counts.ctypes.data + 8 * first_chunk[:-1]
    tensors[:, 5] = forms.ctypes.data + 8 * first_chunk[:-1]
    tensors[:, 6], tensors[:, 7] = range0[:-1], np.diff(range0)
    lib = _need(library())
    lib.ws_encode_sizes(tensors.ctypes.data, len(pairs))
    size = tensors[:, _T_SIZE]
    out_at = np.concatenate([[0], np.cumsum(_aligned(size))])
    total = int(out_at[-1])
    out = np.empty(total, np.uint8) if arena is None else arena.take(total, np.uint8)
    tensors[:, _T_OUT] = out.ctypes.data + out_at[:-1]
    _run("ws_encode_write", tensors, size, total, rows.ctypes.data)
    del keep  # the scratch was read by the write above
    flat = torch.from_numpy(out)
    return [(flat[a : a + s], k) for a, s, k in zip(out_at[:-1].tolist(), size.tolist(), tensors[:, _T_K].tolist())]
