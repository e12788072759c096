"""Zero-copy colocated transfer: engines read the trainer's own tensors in place.

With ``TransportConfig(zero_copy=True)`` (backends ``ipc`` and ``shm``) nothing is packed: the sender
exports the *storage* of every tensor its source yields, once, and receivers import each export once and
keep it across updates; a call then ships only a table of (region, byte offset) per tensor, and each
engine copies straight from the trainer's memory into its own tensors: one device copy per byte instead
of a pack copy plus a load copy.

Regions. A region is one storage of the sender. The sender keys its regions by the storage object (torch
keeps one Python object per live storage) and holds only a weak reference: a storage that dies (a
temporary the source made, a parameter the trainer replaced) is reported to receivers in the next
control header (``drop``), they release their import, and the sender's memory is freed by torch's CUDA
IPC ref counting (``ipc_collect``) or the shared-memory manager. Live storages stay exported, so a
trainer that updates its parameters in place exports them once for the whole run. Region ids only grow,
so a stale id can never name a new storage.

Exports. ``ipc``: torch's CUDA IPC sharing of the storage, one export per receiver (each export carries
one reference; see ``buffers``). ``shm``: torch's file-system sharing (``_share_filename_cpu_``), which
moves a CPU storage into shared memory in place, once (the tensor objects stay valid, like
``model.share_memory()``); one name for every receiver.

Ordering. The sender records an interprocess CUDA event on its current stream after the source produced
the call's tensors; receivers wait for it (host, with the deadline) before loading, and report their
status only after their loads *completed*, so the trainer may overwrite its tensors (an optimizer step)
as soon as its ``update_weights`` returns. A failed call resets every region on both sides.

There is no checksum: no byte is in transit, and a checksum of the same physical memory on both sides
would only re-read it (the configuration rejects ``checksum=True`` with ``zero_copy``).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weight_sync.errors import SourceError, TransportError
from weight_sync.layers.accessors import data_ptr
from weight_sync.layers.source_guard import SourceGuard, same_pointers, source_guard
from weight_sync.manifest import TensorMeta
from weight_sync.transport.buffers import export_ipc_buffer, import_ipc_buffer
from weight_sync.transport.wire import IpcBufferHandle

__all__ = ["EMPTY", "RegionExporter", "RegionImporter", "load_in_place"]

# The region id of a tensor without bytes (nothing is exported for it).
EMPTY = -1
# torch's file-system sharing names its segments '/torch_<pid>_<random>_<counter>'.
_TORCH_SHM_NAME = re.compile(r"^/torch_[0-9]+_[0-9]+_[0-9]+$")


def _whole_storage(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)  # type: ignore[call-overload]


@dataclass(slots=True)
class _Region:
    id: int
    ref: weakref.ref[torch.UntypedStorage]
    ptr: int  # the storage's memory when exported: a storage resized in place (FSDP frees and
    nbytes: int  # re-allocates parameters that way) holds new memory and needs a new export


class RegionExporter:
    """Sender side: exports each storage the source yields once, and tracks which ones died."""

    def __init__(self, backend: str, device: torch.device, receiver_ranks: list[int]) -> None:
        if backend not in ("ipc", "shm"):
            raise TransportError(f"zero-copy needs backend 'ipc' or 'shm', got {backend!r}")
        self.backend = backend
        self.device = device
        self.ranks = receiver_ranks
        self._regions: dict[int, _Region] = {}  # id(storage) -> region
        self._next_id = 0
        self._dropped: list[int] = []
        self._orphans: list[dict[str, Any]] = []  # exported by a call that then failed
        self._reset = False
        # The last table sent per (first, count) of a call, while the manifest and every region stay:
        # a trainer sending the same tensors again ships one flag instead of the table.
        self._tables: dict[tuple[int, int], list[list[int]]] = {}
        self.exported = 0  # regions exported since connect (a trainer updating in place: once per storage)
        # Bumped whenever a region is exported, dropped or forgotten: a table looked up at one epoch
        # names live regions as long as the epoch lasts.
        self.epoch = 0
        # The last whole call's tensors as (their layout guard, data pointers, table, epoch), to know
        # in one pass each that the next call's tensors lie exactly where these did (repeat_rows).
        self._last: tuple[SourceGuard, list[int], list[list[int]], int] | None = None

    def __len__(self) -> int:
        return len(self._regions)

    def shareable(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` as receivers can map it (contiguous: a strided tensor is copied once for this call), or a
        SourceError if it does not live where the backend shares memory."""
        if self.backend == "ipc" and t.device != self.device:
            raise SourceError(
                f"zero-copy ipc: {name!r} is on {t.device}; the sender exports tensors of its own device "
                f"{self.device} only (move it there, or use zero_copy=False to pack it into the buffers)"
            )
        if self.backend == "shm" and t.device.type != "cpu":
            raise SourceError(f"zero-copy shm: {name!r} is on {t.device}; shm shares CPU tensors only")
        return t if t.is_contiguous() else t.contiguous()

    def _region_of(self, storage: torch.UntypedStorage) -> _Region | None:
        """The live export of ``storage``, or None: never exported, or ``id()`` reused by a new storage
        after the exported one died, or resized in place since (new memory)."""
        region = self._regions.get(id(storage))
        if (region is None or region.ref() is not storage or region.ptr != storage.data_ptr()
                or region.nbytes != storage.nbytes()):
            return None
        return region

    def known_rows(self, tensors: list[torch.Tensor]) -> list[list[int]] | None:
        """[region id, byte offset] per tensor when every one lies in a storage exported already (the
        table :meth:`table` would return, with no new region), else None; exports nothing."""
        rows: list[list[int]] = []
        for t in tensors:
            if t.numel() == 0:
                rows.append([EMPTY, 0])
                continue
            region = self._region_of(t.untyped_storage())
            if region is None:
                return None
            rows.append([region.id, int(t.storage_offset()) * t.element_size()])
        return rows

    def table(self, tensors: list[torch.Tensor]) -> tuple[list[dict[str, Any]], list[list[int]]]:
        """(new region records, [region id, byte offset] per tensor) for the call's contiguous tensors."""
        new: list[dict[str, Any]] = []
        rows: list[list[int]] = []
        try:
            for t in tensors:
                if t.numel() == 0:
                    rows.append([EMPTY, 0])  # nothing to map: receivers make an empty tensor
                    continue
                storage = t.untyped_storage()
                region = self._region_of(storage)
                if region is None:
                    region = self._regions.get(id(storage))
                    if region is not None:
                        # id() reused by a new storage after the old one died, or the storage was
                        # resized in place: the old region goes.
                        self._dropped.append(region.id)
                    rid = self._next_id
                    new.append(self._export(rid, storage))
                    # Recorded after the export, which may have moved a CPU storage into shared memory.
                    region = _Region(rid, weakref.ref(storage), storage.data_ptr(), storage.nbytes())
                    self._next_id += 1
                    self.exported += 1
                    self.epoch += 1
                    self._regions[id(storage)] = region
                # The offset in the storage does not change when the export moves it.
                rows.append([region.id, int(t.storage_offset()) * t.element_size()])
        except BaseException:
            self._orphans = new
            raise
        return new, rows

    def _export(self, region_id: int, storage: torch.UntypedStorage) -> dict[str, Any]:
        if self.backend == "ipc":
            whole = _whole_storage(storage)
            # One export per receiver: each carries one reference, released by that receiver's import.
            return {"id": region_id, "nbytes": storage.nbytes(),
                    "exports": {str(r): export_ipc_buffer(whole).to_dict() for r in self.ranks}}
        try:
            manager, name, size = storage._share_filename_cpu_()  # type: ignore[attr-defined]
        except RuntimeError as e:
            raise SourceError(f"zero-copy shm: a {storage.nbytes()}-byte storage cannot be shared: {e}") from e
        return {"id": region_id, "nbytes": int(size), "manager": manager.decode(), "name": name.decode()}

    def payload(self, key: tuple[int, int], regions: list[dict[str, Any]], table: list[list[int]] | None,
                ) -> dict[str, Any]:
        """A call's ``zero_copy`` header field: releases first, then new regions and the table (or
        ``same_table`` when it repeats the last one sent for this run of the manifest)."""
        out = dict(self.releases(), regions=regions, table=table, same_table=False)
        if table is not None:
            if self._tables.get(key) == table:
                out.update(table=[], same_table=True)
            else:
                self._tables[key] = table
        return out

    def forget_tables(self) -> None:
        """A new manifest: tables are keyed by position, so none carries over (receivers do the same)."""
        self._tables.clear()
        self._last = None

    def repeat_rows(self, tensors: list[torch.Tensor]) -> list[list[int]] | None:
        """The table of the last call remembered, when ``tensors`` lie exactly where its tensors lay: the
        same type, dtype, device, shape and strides (one C++ pass), the same data pointers, and every
        region of that table still exported (no region came or went since: memory at a pointer of a
        live region belongs to that region's storage). None otherwise; the caller then checks and
        tables the tensors one by one."""
        last = self._last
        if last is None or last[3] != self.epoch:
            return None
        guard, ptrs, rows, _ = last
        if not guard.check(tensors):
            return None
        return rows if same_pointers(tensors, ptrs) else None

    def remember(self, tensors: list[torch.Tensor], rows: list[list[int]]) -> None:
        """Remember a whole call's tensors (checked against the manifest) and their table for
        :meth:`repeat_rows`."""
        guard = source_guard(tensors)
        self._last = None if guard is None else (guard, list(map(data_ptr, tensors)), rows, self.epoch)

    def control(self) -> dict[str, Any]:
        """What receivers release before anything else in the next header: the regions whose storage
        died since the last header (``drop``), or all of them after a failure (``reset``)."""
        for key, region in list(self._regions.items()):
            if region.ref() is None:
                self._dropped.append(region.id)
                del self._regions[key]
                self.epoch += 1
        out = {"drop": [] if self._reset else self._dropped, "reset": self._reset}
        self._dropped, self._reset = [], False
        return out

    def releases(self) -> dict[str, Any]:
        """:meth:`control` for a header: receivers drop every cached view with any region
        (``RegionImporter.drop``), so the tables they mirror are forgotten here too."""
        out = self.control()
        if out["drop"] or out["reset"]:
            self._tables.clear()
        return out

    def reset(self) -> None:
        """Forget every region (after a failed call); the next header tells receivers to do the same."""
        self._regions.clear()
        self._tables.clear()
        self._last = None
        self.epoch += 1
        self._dropped = []
        self._reset = True

    def abandon(self) -> list[dict[str, Any]]:
        """Reset after this call failed; returns what it exported, which receivers import only to release
        (an export nobody imports would keep its memory referenced for the sender's lifetime)."""
        orphans, self._orphans = self._orphans, []
        self.reset()
        return orphans


class RegionImporter:
    """Receiver side: one import per region, kept until the sender drops it (or resets, or close)."""

    def __init__(self, backend: str, rank: int, device: torch.device) -> None:
        self.backend = backend
        self.rank = rank
        self.device = device  # where empty tensors are made
        self._regions: dict[int, torch.Tensor] = {}
        # Views of the last table per (first, count) (mirrors the sender's table cache).
        self._views: dict[tuple[int, int], list[tuple[str, torch.Tensor]]] = {}

    def __len__(self) -> int:
        return len(self._regions)

    def drop(self, ids: list[int] | None, reset: bool = False) -> None:
        """Release the imports the sender dropped (their storages died on its side)."""
        if reset or ids:
            self._views.clear()  # they would keep the dropped imports alive
        if reset:
            self._regions.clear()
        for rid in ids or ():
            self._regions.pop(int(rid), None)

    def forget_views(self) -> None:
        """A new manifest: cached views are keyed by position (the sender forgets its tables too)."""
        self._views.clear()

    def add(self, records: list[dict[str, Any]]) -> None:
        """Import every new region once."""
        for rec in records:
            rid = int(rec["id"])
            if rid in self._regions:
                raise TransportError(f"[rank {self.rank}] zero-copy: region {rid} was exported twice")
            self._regions[rid] = self._import(rec)

    def _import(self, rec: dict[str, Any]) -> torch.Tensor:
        nbytes = int(rec["nbytes"])
        if self.backend == "ipc":
            exports = rec.get("exports") or {}
            mine = exports.get(str(self.rank))
            if mine is None:
                raise TransportError(f"[rank {self.rank}] zero-copy: region {rec['id']} carries no export for this rank")
            region = import_ipc_buffer(IpcBufferHandle.from_dict(mine))
        else:
            manager, name = str(rec["manager"]), str(rec["name"])
            if not _TORCH_SHM_NAME.match(name) or not Path(manager).is_absolute():
                raise TransportError(
                    f"[rank {self.rank}] zero-copy: region {rec['id']} names shared memory {name!r} via manager "
                    f"{manager!r}, expected torch's '/torch_<pid>_<n>_<n>' and an absolute socket path"
                )
            storage = torch.UntypedStorage._new_shared_filename_cpu(  # type: ignore[attr-defined]
                manager.encode(), name.encode(), nbytes
            )
            region = _whole_storage(storage)
        if region.numel() != nbytes:
            raise TransportError(
                f"[rank {self.rank}] zero-copy: region {rec['id']} maps {region.numel()} bytes, announced {nbytes}"
            )
        return region

    def call_views(self, key: tuple[int, int], zc: dict[str, Any], metas: tuple[TensorMeta, ...],
                   ) -> list[tuple[str, torch.Tensor]]:
        """The call's (name, view) list: built from its table, or the cached one it repeats."""
        if zc.get("same_table"):
            cached = self._views.get(key)
            if cached is None:
                raise TransportError(
                    f"[rank {self.rank}] zero-copy: the sender repeats the table of tensors {key[0]}..."
                    f"{key[0] + key[1]}, which this receiver does not hold"
                )
            return cached
        views = self.views(zc["table"], metas)
        self._views[key] = views
        return views

    def views(self, rows: list[list[int]], metas: tuple[TensorMeta, ...]) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) for each row: a typed view into an imported region, bounds-checked."""
        if len(rows) != len(metas):
            raise TransportError(
                f"[rank {self.rank}] zero-copy: the call's table has {len(rows)} rows for {len(metas)} tensors"
            )
        out = []
        for (rid, offset), meta in zip(rows, metas):
            if rid == EMPTY and meta.nbytes == 0:
                out.append((meta.name, torch.empty(meta.shape, dtype=meta.dtype, device=self.device)))
                continue
            region = self._regions.get(int(rid))
            if region is None:
                raise TransportError(f"[rank {self.rank}] zero-copy: {meta.name!r} is in region {rid}, never exported")
            itemsize = meta.dtype.itemsize
            if offset < 0 or offset % itemsize or offset + meta.nbytes > region.numel():
                raise TransportError(
                    f"[rank {self.rank}] zero-copy: {meta.name!r} ({meta.nbytes} bytes at offset {offset}) does not "
                    f"fit region {rid} of {region.numel()} bytes with {itemsize}-byte alignment"
                )
            raw = region[offset : offset + meta.nbytes]
            out.append((meta.name, raw.view(meta.dtype).view(meta.shape)))
        return out

    def close(self) -> None:
        self._views.clear()
        self._regions.clear()


def load_in_place(
    importer: RegionImporter,
    key: tuple[int, int],
    zc: dict[str, Any],
    metas: tuple[TensorMeta, ...],
    session: Any,
    channel: Any,
    sender_event: Any,
    shim: Any,
    loaded_hook: Callable[[], None] | None = None,
) -> int:
    """Load one zero-copy call into ``session`` straight from the sender's memory; returns the count.

    Returns only once the loads *completed*: the sender may overwrite its tensors as soon as the call's
    status exchange is over. ``loaded_hook`` runs once the loads are queued, while the device copies.
    """
    views = importer.call_views(key, zc, metas)
    if sender_event is not None:
        # A host wait with the deadline (not a stream wait): a rollback snapshot is a blocking copy that
        # must never sit behind a sender that never gets there.
        channel.wait_event(sender_event, "update_weights: the sender's tensors", "the sender's device (rank 0)")
    session.load(views)
    if loaded_hook is not None:
        loaded_hook()
    if shim.is_cuda:
        done = shim.event()
        done.record(shim.current_stream())
        channel.wait_event(done, "update_weights: loading from the sender's tensors")
    return len(views)
