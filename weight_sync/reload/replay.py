"""A repeated list of keys into direct or band-quantized layers, written in a few batches.

An RL loop sends the same keys in the same buckets at every step, and a bucket of a model with many small
tensors (a MoE layer: 384 expert slices) spends most of its host time in the per-key checks and writes of
``UpdateSession.load`` (~3-5 us per name; the copies themselves are queued and launched together). When a
list's keys all go through the session's cached destination views (the hot path) into direct layers or
into layers quantized band by band (fp8 per-channel and 128x128 blocks: ``reload/bands.py``), the list is
recorded as a :class:`ListReplay` the first time it loads cleanly: the destination of every key, the
layout each key arrived in and the layers it writes, in pieces (of ``FIRST_PIECE_KEYS`` keys, doubling up
to ``PIECE_KEYS``). The next time a list with the same names in the same order arrives, the session
checks each piece's tensors against that record (a tensor, same shape, same dtype, same device), checks
the manifest's announcement of them and that no key arrived earlier in the update, and only then writes
the piece: big copies one by one, as the hot path launches them but alternated over two streams
(``reload/lanes.py``), the others in one grouped copy (``grouped_copy.CopyGroup``), band quantizations as
one grouped launch per method and shape - all of which the device runs while the host checks the next
piece. Bands of one-scale matrices (per-tensor fp8: a fused qkv, an expert's gate and up) are recorded
when each matrix is whole within the list; a piece then ends only where no matrix is open, so each goes
to its method with all of its rows at once (absmax first, as the write queue hands them over). Anything
else - another layout, a name announced otherwise, a cached view rebuilt since (pointers moved), a
duplicate - and the per-key path takes over from that piece on, which loads what is valid and raises the
precise error for what is not. So every guarantee of the per-key path holds (manifest first, duplicates
refused, layers snapshotted before their first write); the record only skips the work that repeats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from weight_sync.layers.accessors import (
    PLAIN_TYPES,
    all_plain,
    dim,
    dtype_of,
    get_device,
    numel,
    rows,
    shape_by_counts,
    shape_of,
)
from weight_sync.layers.source_guard import SourceGuard, source_guard
from weight_sync.reload.bands import band_target
from weight_sync.reload.grouped_copy import CopyGroup
from weight_sync.reload.lanes import copy_pairs
from weight_sync.reload.plan import dst_view
from weight_sync.reload.writes import SMALL_COPY_BYTES

__all__ = ["ListReplay", "list_names", "record_list", "replay_list"]

_second = itemgetter(1)
_first = itemgetter(0)  # the name of a (name, tensor) pair, in C: this runs for every key of every call

# Records kept per model (one per distinct bucket layout); beyond this the oldest half is dropped.
MAX_RECORDS = 256
# Clean loads of a list that may try to record it (the first may be its layers' first processing).
RECORD_ATTEMPTS = 3
# Keys per piece of a replayed list: each piece is checked, then written, while the device still copies
# the previous one (a 6k-key MoE list is checked in ~3 ms of host time, written in ~10 ms of device time).
# The first pieces are small, so the device starts early; later ones grow to PIECE_KEYS, so the fixed
# cost of a launch (~50 us of host time) is paid a few times per list, not once per few keys. The device
# idles while the host checks and snapshots the first piece (an 8B model's first 128 keys reach ~90
# layers): 32 keys start it after ~20 layers, with ~1 ms of copies queued for the host to run ahead of.
FIRST_PIECE_KEYS = 32
PIECE_KEYS = 1024


def piece_size(grown: int, left: int) -> int:
    """Keys of the next piece: ``grown`` (doubling from FIRST_PIECE_KEYS up to PIECE_KEYS), but at most half
    of the ``left`` keys of the list (at least FIRST_PIECE_KEYS). The update waits after its last piece is
    launched for that piece's device work alone when the host kept pace with the device (a 6k-name MoE
    list: ~1.5 ms for a 1024-key piece of expert slices, ~0.2 ms for a 128-key one), so pieces shrink
    again towards the end of the list as they grew at its start."""
    least = min(FIRST_PIECE_KEYS, PIECE_KEYS)
    if left <= least + least // 2:
        return left  # no piece of a few keys after it: each piece costs its launches (~50 us of host time)
    return min(grown, max(least, left // 2))


@dataclass(eq=False, slots=True)
class Piece:
    """The writes of keys ``start:stop`` of a recorded list."""

    start: int
    stop: int
    big: tuple[tuple[torch.Tensor, int], ...]  # (destination, index of its source), copied one by one
    small: CopyGroup  # destinations of one grouped copy ...
    small_src: tuple[int, ...]  # ... and the index of each one's source
    layers: tuple[str, ...]  # the layers its keys write (snapshotted before the piece is written)
    nbytes: int
    # Band quantizations into live kernel tensors (reload/bands.py), per quantize callable and source
    # dtype: (quantize, index of each source, its qweight rows, its scale rows, the method's launch made
    # ready for these targets or None); launched grouped, as the write queue would.
    bands: tuple[tuple[Callable[..., None], tuple[int, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...],
                       Any], ...]
    # The recorded sources' type, dtype, device, shape and (contiguous) strides, checked in one C++ pass
    # (layers/source_guard.py); None: checked per property. A passing check proves them contiguous.
    guard: SourceGuard | None


@dataclass(eq=False, slots=True)
class ListReplay:
    """The writes of one list of keys into direct layers, as the hot path would make them."""

    # ``ModelState.views_epoch`` when recorded: the cached views every key was written through are
    # the ones of that epoch, and valid while it lasts (clearing them starts another).
    epoch: int
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    # Each shape as (dim, numel, rows) counts, which determine every shape of the list when ``by_counts``
    # (all 1-d or 2-d, no zero size: accessors.shape_by_counts); the check then reads no torch.Size.
    by_counts: bool
    dims: tuple[int, ...]
    numels: tuple[int, ...]
    rows: tuple[int, ...]
    device: int  # Tensor.get_device() of every source and destination (-1: host memory)
    pieces: tuple[Piece, ...]
    name_set: frozenset[str]  # the list's names, joining an update's arrivals at once (replay_list)
    # The manifest announcement the list was loaded under (every entry matched it). A later update
    # announcing the same manifest gets the same object back (reload/validation.py caches it).
    announced: dict[str, tuple[torch.Size, torch.dtype]] | None


def list_names(items: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, ...]:
    """The key of a list's record: its names in order."""
    return tuple(map(_first, items))


def record_list(session: Any, items: Sequence[tuple[str, torch.Tensor]], names: tuple[str, ...]) -> None:
    """After ``items`` (named ``names``) loaded cleanly: record them for replay if every key went through
    the hot path."""
    records = session.state.replays
    prev = records.get(names)
    if isinstance(prev, ListReplay) or (prev is not None and prev >= RECORD_ATTEMPTS):
        return
    if prev is None and len(records) >= MAX_RECORDS:
        for key in list(records)[: MAX_RECORDS // 2]:
            del records[key]
    # Until proven otherwise: not replayable (the per-key path), counted as one more failed attempt.
    # A list can fail for a reason of its update alone (its layers were processed for the first time,
    # so no band path yet): it is tried again at the next clean load, up to RECORD_ATTEMPTS times.
    records[names] = (prev or 0) + 1
    views = session._views
    shapes, dtypes, pieces = [], [], []
    big: list[tuple[torch.Tensor, int]] = []
    small: list[torch.Tensor] = []
    small_src: list[int] = []
    layers: dict[str, None] = {}
    written: set[int] = set()  # destinations' data_ptr: one batch writes each place once
    device: int | None = None
    nbytes = start = 0
    grown = min(FIRST_PIECE_KEYS, PIECE_KEYS)
    size = piece_size(grown, len(items))
    bands: dict[tuple[Callable[..., None], torch.dtype],
                tuple[list[int], list[torch.Tensor], list[torch.Tensor], list[tuple[int, int]], Any]] = {}
    # One-scale matrices (per-tensor scales) with rows still to come, by their scale view's data_ptr:
    # rows missing. A piece ends only where none is open, so each is quantized whole by its piece.
    open_rows: dict[int, int] = {}
    banded = session._banded
    for i, (name, tensor) in enumerate(items):
        entry = views.get(name)
        if entry is None or type(tensor) not in PLAIN_TYPES:  # a subclass: the per-key path, always
            return
        kp, _ = entry
        dev = tensor.get_device()
        if device is None:
            device = dev
        if dev != device:
            return
        for op in kp.ops:
            layer_bands = banded.get(op.layer) if banded else None
            band = layer_bands.get(op.tensor) if layer_bands is not None else None
            if band is not None:
                # Quantized band by band into the live kernel tensors. Not recorded: part of a key, or a
                # source the band writer would first convert (another dtype than the model format's,
                # another device), or a one-scale matrix not whole within the list.
                info = session.state.layers[op.layer]
                if not op.src_whole or tensor.dim() != 2 or info.records[op.tensor].dtype is not tensor.dtype:
                    return
                q, sc = band_target(info, band, op)
                if q.get_device() != device or q.data_ptr() in written:
                    return
                written.add(q.data_ptr())
                if band.matrix_rows:
                    left = open_rows.get(sc.data_ptr(), band.matrix_rows) - tensor.shape[0]
                    if left < 0:
                        return
                    if left:
                        open_rows[sc.data_ptr()] = left
                    else:
                        open_rows.pop(sc.data_ptr(), None)
                idx, qs, ss, shapes_of, _ = bands.setdefault((band.quantize, tensor.dtype), ([], [], [], [], band.table))
                idx.append(i)
                qs.append(q)
                ss.append(sc)
                shapes_of.append((tensor.shape[0], tensor.shape[1]))
                continue
            base, staged = session._target(op)
            if base is None or staged or not op.src_whole:
                return
            dst = dst_view(base, op)
            if dst.dtype is not tensor.dtype or dst.get_device() != device or dst.data_ptr() in written:
                # Two keys into one place (a tied weight): the per-key path keeps their order, one
                # grouped copy would not.
                return
            written.add(dst.data_ptr())
            if tensor.nbytes > SMALL_COPY_BYTES:
                big.append((dst, i))
            else:
                small.append(dst)
                small_src.append(i)
        layers.update(dict.fromkeys(kp.layers))
        shapes.append(tensor.shape)
        dtypes.append(tensor.dtype)
        nbytes += tensor.nbytes
        if (i + 1 - start >= size and not open_rows) or i + 1 == len(items):
            if open_rows:
                return  # a one-scale matrix's other rows are not in this list
            pieces.append(Piece(start, i + 1, tuple(big), CopyGroup(small), tuple(small_src), tuple(layers), nbytes,
                                tuple(_band_group(fn, dtype, *group) for (fn, dtype), group in bands.items()),
                                source_guard([t for _, t in items[start:i + 1]])))
            big, small, small_src, layers, nbytes, start, bands = [], [], [], {}, 0, i + 1, {}
            grown = min(2 * grown, PIECE_KEYS)
            size = piece_size(grown, len(items) - start)
    assert device is not None
    records[names] = ListReplay(session.state.views_epoch, tuple(shapes), tuple(dtypes),
                                all(map(shape_by_counts, shapes)), tuple(map(len, shapes)),
                                tuple(s.numel() for s in shapes), tuple(s[0] if s else 0 for s in shapes),
                                device, tuple(pieces), frozenset(names), session._announced)


def _band_group(quantize: Callable[..., None], dtype: torch.dtype, idx: list[int], qs: list[torch.Tensor],
                ss: list[torch.Tensor], shapes: list[tuple[int, int]], table: Any) -> tuple[Any, ...]:
    """One entry of ``Piece.bands``: the method's launch is made ready here when it offers one."""
    ready = table(list(zip(qs, ss)), shapes, dtype) if table is not None else None
    return quantize, tuple(idx), tuple(qs), tuple(ss), ready


def replay_list(session: Any, items: Sequence[tuple[str, torch.Tensor]], names: tuple[str, ...]) -> int:
    """Write ``items`` (named ``names``) as their record says, piece by piece; how many leading items
    were written (0: nothing, the per-key path runs on the whole list).

    A piece is checked whole before it is written. When one fails its check, the pieces before it are
    written (each key of them valid, as the per-key path would have written it) and the per-key path
    takes the rest from there, which loads what is valid and raises the precise error for what is not.
    """
    records = session.state.replays
    rec = records.get(names)
    if not isinstance(rec, ListReplay):
        return 0
    tensors = list(map(_second, items))
    arrived = session._arrived
    # Nothing arrived yet in this update (its first load call): no piece can repeat a key - a recorded
    # list names none twice - so the pieces are not checked against arrivals one by one, and the whole
    # list's names join them at the end from the record's set (one clean set copy, not a probe per
    # name per piece). Whatever ends the loop, the names of the pieces written are in by then.
    fresh = not arrived
    done = 0
    try:
        for piece in rec.pieces:
            if not _replay_piece(session, rec, piece, names, tensors, fresh):
                # Recorded at another layout, or a cached view was rebuilt since: the per-key path runs
                # and records the list again if it still qualifies.
                del records[names]
                return piece.start
            done = piece.stop
    finally:
        if fresh:
            arrived.update(rec.name_set if done == len(names) else names[:done])
    if rec.announced is not session._announced and session._announced is not None:
        rec.announced = session._announced  # every entry matched it: the next update announcing it skips that
    return len(names)


def _replay_piece(session: Any, rec: ListReplay, piece: Piece, names: tuple[str, ...], tensors: list[Any],
                  fresh: bool) -> bool:
    """Check one piece, then write it (True); False, nothing written, when it fails its check."""
    a, b = piece.start, piece.stop
    if not _valid(session, rec, piece, names, tensors, fresh):
        return False
    prepare = session._prepare
    for layer in piece.layers:
        prepare(layer)  # the rollback snapshot of a layer before its first write
    contiguous = piece.guard is not None  # (proven by its check)
    if piece.big:
        copy_pairs([(dst, tensors[i]) for dst, i in piece.big], rec.device)
    if piece.small_src:
        piece.small.copy(list(map(tensors.__getitem__, piece.small_src)), contiguous)
    if piece.bands:
        queued = session._writes.bands
        flush = False
        for quantize, idx, qs, ss, ready in piece.bands:
            srcs = list(map(tensors.__getitem__, idx))
            if ready is not None and ready.launch(srcs, contiguous):
                continue  # launched from the table made at the record: only the sources were read
            items_of = queued.get(quantize)
            if items_of is None:
                items_of = queued[quantize] = []
            items_of.extend(zip(srcs, qs, ss))
            flush = True
        if flush:
            session._writes.flush()  # one grouped launch per method and shape, while the host goes on
    if not fresh:
        session._arrived.update(names[a:b])
    session._num_bytes += piece.nbytes
    session._replayed += b - a
    return True


def _valid(session: Any, rec: ListReplay, piece: Piece, names: tuple[str, ...], tensors: list[Any],
           fresh: bool) -> bool:
    """Whether the piece's tensors (named as the piece's ``names``) are what ``rec`` recorded, announced as
    such, and none arrived before (known when ``fresh``: nothing had arrived when the list's replay began)."""
    a, b = piece.start, piece.stop
    names, tensors = names[a:b], tensors[a:b]
    # The cached views of the record's epoch (a view is only ever dropped with all the others), then
    # type, dtype, shape and device of every tensor: in one C++ pass where the piece has a guard, else
    # each as one C-level pass, the type pass before any attribute is read.
    if rec.epoch != session.state.views_epoch:
        return False
    if piece.guard is not None:
        if not piece.guard.check(tensors):
            return False
    elif not _valid_per_property(rec, tensors, a, b):
        return False
    announced = session._announced
    if announced is not None and announced is not rec.announced:  # else known to match (or none announced)
        for name, t in zip(names, tensors):
            want = announced.get(name)
            if want is None or want[1] is not t.dtype or want[0] != t.shape:
                return False
    return fresh or session._arrived.isdisjoint(names)


def _valid_per_property(rec: ListReplay, tensors: list[Any], a: int, b: int) -> bool:
    """Type, dtype, shape and device of ``tensors`` (the record's ``a:b``), one C-level pass each."""
    if not all_plain(tensors):
        return False
    if tuple(map(dtype_of, tensors)) != rec.dtypes[a:b]:
        return False
    if rec.by_counts:
        # dims first: rows() of a tensor is only compared once its dim is the recorded one.
        if (tuple(map(dim, tensors)) != rec.dims[a:b] or tuple(map(numel, tensors)) != rec.numels[a:b]
                or tuple(map(rows, tensors)) != rec.rows[a:b]):
            return False
    elif tuple(map(shape_of, tensors)) != rec.shapes[a:b]:
        return False
    return set(map(get_device, tensors)) == {rec.device}
