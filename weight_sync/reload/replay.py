"""A repeated list of keys into direct layers, written as one batch.

An RL loop sends the same keys in the same buckets at every step, and a bucket of a model with many
small tensors (a MoE layer: 384 expert slices) spends most of its host time in the per-key checks and
writes of ``UpdateSession.load`` (~3-5 us per name; the copies themselves are queued and launched
together). When a list's keys all go into direct layers through the session's cached destination views
(the hot path), the list is recorded as a :class:`ListReplay` the first time it loads cleanly: the
destination of every key, the layout each key arrived in and the layers it writes. The next time a list
with the same names in the same order arrives, the session checks each tensor against that record (a
tensor, same shape, same dtype, same device), checks the manifest's announcement of it and that no key
arrived earlier in the update, and only then writes: big copies one by one, as the hot path launches
them, the others in one ``torch._foreach_copy_``. Anything else - another layout, a name announced
otherwise, a cached view rebuilt since (pointers moved), a duplicate - and the call takes the per-key path,
which loads what is valid and raises the precise error for what is not. So every guarantee of the per-key
path holds (manifest first, duplicates refused, layers snapshotted before their first write); the
record only skips the work that repeats.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import torch

from weight_sync.reload.plan import dst_view
from weight_sync.reload.writes import SMALL_COPY_BYTES

__all__ = ["ListReplay", "list_names", "record_list", "replay_list"]

_second = itemgetter(1)
_first = itemgetter(0)  # the name of a (name, tensor) pair, in C: this runs for every key of every call

# Records kept per model (one per distinct bucket layout); beyond this the oldest half is dropped.
MAX_RECORDS = 256


@dataclass(eq=False, slots=True)
class ListReplay:
    """The writes of one list of keys into direct layers, as the hot path would make them."""

    entries: tuple[Any, ...]  # the session's cached hot-path entry of each name (identity-checked)
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    device: int  # Tensor.get_device() of every source and destination (-1: host memory)
    big: tuple[tuple[torch.Tensor, int], ...]  # (destination, index of its source), copied one by one
    small: list[torch.Tensor]  # destinations of one grouped copy ...
    small_src: tuple[int, ...]  # ... and the index of each one's source
    layers: tuple[str, ...]
    nbytes: int
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
    if names in records:
        return
    if len(records) >= MAX_RECORDS:
        for key in list(records)[: MAX_RECORDS // 2]:
            del records[key]
    records[names] = None  # until proven otherwise: not replayable (the per-key path each time)
    views = session._views
    entries, shapes, dtypes, big, small, small_src = [], [], [], [], [], []
    layers: dict[str, None] = {}
    written: set[int] = set()  # destinations' data_ptr: one batch writes each place once
    device: int | None = None
    nbytes = 0
    for i, (name, tensor) in enumerate(items):
        entry = views.get(name)
        if entry is None or not isinstance(tensor, torch.Tensor):
            return
        kp, _ = entry
        dev = tensor.get_device()
        if device is None:
            device = dev
        if dev != device:
            return
        for op in kp.ops:
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
        entries.append(entry)
        shapes.append(tensor.shape)
        dtypes.append(tensor.dtype)
        nbytes += tensor.nbytes
    assert device is not None
    records[names] = ListReplay(tuple(entries), tuple(shapes), tuple(dtypes), device, tuple(big), small,
                                tuple(small_src), tuple(layers), nbytes, session._announced)


def replay_list(session: Any, items: Sequence[tuple[str, torch.Tensor]], names: tuple[str, ...]) -> bool:
    """Write ``items`` (named ``names``) as their record says; False (nothing written) when the per-key
    path must run."""
    records = session.state.replays
    rec = records.get(names)
    if rec is None:
        return False
    if not _valid(session, rec, names, items):
        # Recorded at another layout, or a cached view was rebuilt since: the per-key path runs and
        # records the list again if it still qualifies.
        del records[names]
        return False
    for layer in rec.layers:
        session._prepare(layer)  # the rollback snapshot of a layer before its first write
    tensors = list(map(_second, items))
    for dst, i in rec.big:
        dst.copy_(tensors[i])
    if rec.small:
        torch._foreach_copy_(rec.small, [tensors[i] for i in rec.small_src])
    session._arrived.update(names)
    session._num_bytes += rec.nbytes
    session._replayed += len(names)
    return True


def _valid(session: Any, rec: ListReplay, names: tuple[str, ...],
           items: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Whether ``items`` are what ``rec`` recorded, announced as such, and none arrived before."""
    views_get = session._views.get
    announced = session._announced
    if announced is rec.announced:
        announced = None  # what the list was recorded under: each entry is known to match it
    device = rec.device
    for (name, t), entry, shape, dtype in zip(items, rec.entries, rec.shapes, rec.dtypes):
        if (views_get(name) is not entry or not isinstance(t, torch.Tensor) or t.dtype is not dtype
                or t.shape != shape or t.get_device() != device):
            return False
        if announced is not None:
            a = announced.get(name)
            if a is None or a[1] is not dtype or a[0] != shape:
                return False
    return session._arrived.isdisjoint(names)
