"""Weight updates into an offloaded model: the reload lifecycle writes the host storage the streamer reads.

An offloaded block's parameters point at a device slot between forwards, and the slot is overwritten by
the next load, so an update cannot write there. :class:`OffloadUpdater` is registered with the reload
lifecycle (``weight_sync.reload.api.register_update_hook``) for the offloaded root and every DiT that owns
a ring, so ``begin_update`` / ``reload_weights`` / the transport receivers on either of them work
unchanged. Before the session opens (and snapshots pointers) it

1. drains the streamer: every queued load finishes and stale prefetches are dropped (the next forward
   loads its first block again), so no copy reads host storage while it is written;
2. moves off read-only host weights (a checkpoint mmap pinned in place or staged, a runtime-cache entry):
   they are never written. The first update copies them into a private arena, pinned where it can be,
   when ``update_host_budget_bytes`` allows (default: the host's MemAvailable); otherwise the update is
   refused with the reason before anything is written. Cache entries and the checkpoint stay as they
   were for their other readers;
3. presents host tensors as the blocks' kernel tensors, so the session writes them in place:
   - without AllGather, views of each block's bytes in the packed arena (in place; they stay the
     parameters' storage until the next forward, so a fingerprint taken then hashes the new weights);
   - with AllGather, views of a per-block *scratch* region of an anonymous, reserve-free mapping. A
     block's scratch gets this rank's shard from the arena when its first key arrives; when its last
     expected key has been loaded (or at finish), only this rank's 1/dp shard goes back into the arena
     and the scratch pages are returned to the OS. A stream in block order holds one block of scratch;
     the arena stays 1/dp of the blocks.

Resident blocks and non-block tensors are device tensors the session writes in place, as on a resident
model. While an update is open, and while the model is torn, every block forward is refused
(``weight_sync.reload.check_servable``). Rollback works as on a resident model: the session's snapshots
restore the arena views in place; with AllGather the shards of blocks already written back are restored
from copies of their previous bytes (1/dp each, taken only with ``rollback=True``).

Quantized offloads (``OffloadConfig.quantization``) requantize on update: before the session opens, every
``QuantizedLinear`` is declared a processed layer whose model format is the full-precision linear it
replaced (``weight_sync.offload.quantize.declare_requantization``). Its keys fill model-format staging on
the session's device; when the layer's last key arrives the registry's processor quantizes it, and the
fp8 (or int8) weight, its scales and the bias are copied into the kernel tensors, which are the host
views above: the arena in place, or the AllGather scratch whose shard goes back as for any block (every
rank quantizes whole linears, because a scale needs its whole tile, row or tensor, and keeps only its
1/dp shard). The bytes equal those of a fresh offloaded load quantized the same way. Without a key list
(no manifest and no earlier full update) the session processes every layer at finish, so with AllGather
the scratch of every block written is held until then.

Limitations: with AllGather a key must land in the block its name is under (``blocks.3.*`` in block 3, as
the transports' block order assumes), and the session's report carries no fingerprint (no rank holds the
full weights on the host): :meth:`weight_sync.offload.OffloadHandle.fingerprint` (collective) gives it.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from weight_sync.errors import ConfigError, UpdateStateError
from weight_sync.layers import repoint
from weight_sync.offload.host_store import PackedStore
from weight_sync.offload.layout import BlockLayout
from weight_sync.offload.pinned import PinError, register_region
from weight_sync.offload.quantize import declare_requantization

if TYPE_CHECKING:
    from weight_sync.offload.handle import OffloadHandle
    from weight_sync.reload.session import UpdateSession

__all__ = ["OffloadUpdater"]

logger = logging.getLogger(__name__)


def _mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _ShardScratch:
    """Full-block host views for an AllGather rank that keeps only its shard of each block.

    One anonymous ``MAP_NORESERVE`` mapping of every block's padded size, reserved once for the life of
    the offload: addresses stay the same from update to update (the session's destination views stay
    valid), and pages cost memory only between a block's first write and its write-back.
    """

    def __init__(self, layouts: list[BlockLayout], store: PackedStore, rank: int) -> None:
        page = mmap.PAGESIZE
        self.store, self.rank = store, rank
        self.offsets: list[int] = []
        end = 0
        for lay in layouts:
            end = (end + page - 1) // page * page  # page-aligned, so each block's pages can be released
            self.offsets.append(end)
            end += lay.padded_bytes
        self.layouts = layouts
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_NORESERVE", 0)
        self.map = mmap.mmap(-1, max(end, 1), flags=flags)
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        self.views = [
            tuple(p.view(self.region(lay.index)) for p in lay.placements) for lay in layouts
        ]
        self.open: set[int] = set()  # blocks holding scratch pages (shard materialized, not written back)
        self.written: set[int] = set()  # blocks written back into the arena in this update
        self.saved: dict[int, torch.Tensor] = {}  # previous shard bytes of written blocks (rollback)
        self.peak_bytes = 0

    def region(self, index: int) -> torch.Tensor:
        off = self.offsets[index]
        return self.base[off : off + self.layouts[index].padded_bytes]

    def _shard(self, index: int) -> torch.Tensor:
        s = self.layouts[index].shard_bytes
        return self.region(index)[self.rank * s : (self.rank + 1) * s]

    def materialize(self, index: int) -> None:
        """Before block ``index``'s first write: its scratch shard holds this rank's current bytes, so
        what the update does not write (another tensor, padding) goes back into the arena unchanged."""
        if index in self.open:
            return
        # A block written back earlier in this update (a stream that came back to it) starts from what
        # the arena holds now: its earlier writes are kept.
        self._shard(index).copy_(self.store.block_bytes(index))
        self.open.add(index)
        self.peak_bytes = max(self.peak_bytes, sum(self.layouts[i].padded_bytes for i in self.open))

    def write_back(self, index: int, *, keep_previous: bool) -> None:
        """Copy this rank's shard of block ``index`` into the arena and release the block's pages."""
        if index not in self.open:
            return
        dst = self.store.block_bytes(index)
        if keep_previous and index not in self.saved:
            self.saved[index] = dst.clone()  # the bytes from before this update, for rollback
        dst.copy_(self._shard(index))
        self.written.add(index)
        self._release(index)

    def restore_written(self) -> None:
        """Rollback: put the previous shard bytes of every block written back in this update."""
        for index, previous in self.saved.items():
            self.store.block_bytes(index).copy_(previous)

    def _release(self, index: int) -> None:
        self.open.discard(index)
        # Private anonymous pages: DONTNEED drops them and later reads see zeros; the address stays ours.
        self.map.madvise(mmap.MADV_DONTNEED, self.offsets[index], self.layouts[index].padded_bytes)

    def end_update(self) -> None:
        for index in list(self.open):
            self._release(index)
        self.written.clear()
        self.saved.clear()

    @property
    def resident_bytes(self) -> int:
        return sum(self.layouts[i].padded_bytes for i in self.open)

    def close(self) -> None:
        self.views.clear()
        del self.base
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes when it does
            self.map.close()


class OffloadUpdater:
    """The reload lifecycle's hook for one offload (see the module docstring)."""

    def __init__(self, handle: OffloadHandle) -> None:
        self.handle = handle
        self.session: UpdateSession | None = None
        self._models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._registered: list[nn.Module] = []
        self._scratch: _ShardScratch | None = None
        self._prefix_of: list[str | None] = []
        self._block_of: dict[str, int | None] = {}
        self._remaining: dict[int, int] = {}
        self._seen: set[str] = set()
        self._by_order = False

    # -- registration --------------------------------------------------------------------------
    def install(self, modules: Iterable[nn.Module]) -> None:
        from weight_sync.reload.api import register_update_hook

        for m in modules:
            if all(m is not r for r in self._registered):
                register_update_hook(m, self)
                self._registered.append(m)

    def remove(self) -> None:
        """Called by ``disable()``: the resident model is updated as any model is, without this hook."""
        from weight_sync.reload.api import unregister_update_hook

        if self.session is not None:
            raise ConfigError(
                f"update {self.session.version!r} is open on the offloaded model; finish or abort it "
                "before disable()"
            )
        for m in self._registered:
            unregister_update_hook(m, self)
        self._registered.clear()
        if self._scratch is not None:
            self._scratch.close()
            self._scratch = None

    def check_servable(self) -> None:
        """Before a block forward: refuse during an open update or on a torn model (the reload rule)."""
        from weight_sync.reload.state import check_servable

        for m in list(self._models):
            check_servable(m)

    # -- the UpdateHook protocol ---------------------------------------------------------------
    def before_begin(self, model: nn.Module) -> None:
        h = self.handle
        if not h.enabled:
            return
        if h.config.quantization is not None:
            # Before anything is written: the quantized linears become processed layers whose model
            # format is the full-precision linear they replaced (an update requantizes them). Also
            # when every block is resident: the reload lifecycle alone would take their fp8 tensors for
            # the model format.
            declare_requantization(model)
        if h.streamer is None:
            return
        if self.session is not None:
            raise UpdateStateError(
                f"update {self.session.version!r} is open on this offloaded model (begun on another of "
                "its modules); finish or abort it first"
            )
        h.streamer.drain()
        store = self._private_store()
        if store.shard is None:
            for lay in h.layouts:
                block = store.block_bytes(lay.index)
                for p in lay.placements:
                    repoint(p.tensor, p.view(block))
        else:
            if self._scratch is None:
                self._scratch = _ShardScratch(h.layouts, store, store.shard[0])
            for lay, views in zip(h.layouts, self._scratch.views):
                for p, v in zip(lay.placements, views):
                    repoint(p.tensor, v)
            self._index_blocks(model)
        self._models.add(model)
        h.streamer.before_block = self.check_servable

    def opened(self, session: UpdateSession) -> None:
        if not self.handle.enabled or self.handle.streamer is None:
            return
        self.session = session
        if self._scratch is None:
            return
        # No rank holds the full new weights on the host: the report's fingerprint would hash released
        # scratch pages. handle.fingerprint() gathers the served weights instead.
        session.compute_fingerprint = False
        self._seen = set()
        self._remaining = {}
        # Without a key list a block counts as complete when the stream moves on to another block (block
        # order is the transports' protocol); a key coming back to it later re-opens it from the arena.
        # Not when quantized: without a key list the session processes (requantizes) every layer at
        # finish, so each block's scratch must hold its new bytes until then (written back at close).
        self._by_order = session.expected is None and self.handle.config.quantization is None
        for name in session.expected or ():
            b = self._block(name)
            if b is not None:
                self._remaining[b] = self._remaining.get(b, 0) + 1
        load = session.load

        def load_tracked(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
            if type(named_tensors) in (list, tuple):
                items = list(named_tensors)
                blocks = {self._block(name) for name, _ in items}
                if self._by_order and self._scratch is not None:
                    for index in sorted(self._scratch.open - blocks):  # type: ignore[operator]
                        self._scratch.write_back(index, keep_previous=session.rollback)
                # Every block of the batch is materialized before the session writes any of it.
                for name, _ in items:
                    self._arriving(name, write_back_others=False)
                load(named_tensors)
                for name, _ in items:
                    self._arrived(name)
                if items and self._by_order:
                    self._write_back_except(self._block(items[-1][0]))
                return
            load(self._tracked(named_tensors))

        session.load = load_tracked  # type: ignore[method-assign]

    def closed(self, session: UpdateSession | None) -> None:
        h = self.handle
        self.session = None
        scratch = self._scratch
        if scratch is not None:
            if session is not None and session.status == "finished":
                for index in sorted(scratch.open):
                    scratch.write_back(index, keep_previous=False)
            elif session is not None and session.rollback:
                scratch.restore_written()
            h._metrics.update_scratch_peak_bytes = max(
                h._metrics.update_scratch_peak_bytes, scratch.peak_bytes
            )
            scratch.end_update()
            if h.streamer is not None:
                # Off the scratch: it holds nothing now; the next forward re-points to a slot anyway.
                for lay in h.layouts:
                    for p, v in zip(lay.placements, h.streamer.views[lay.index][0]):
                        repoint(p.tensor, v)
        if session is not None and session.status == "finished":
            h._metrics.num_updates += 1

    # -- AllGather bookkeeping -----------------------------------------------------------------
    def _index_blocks(self, model: nn.Module) -> None:
        assert self.handle.streamer is not None
        names = {id(m): n for n, m in model.named_modules()}
        self._prefix_of = [names.get(id(m)) for m in self.handle.streamer.modules]
        self._block_of = {}

    def _block(self, name: str) -> int | None:
        if name not in self._block_of:
            found = None
            for i, prefix in enumerate(self._prefix_of):
                if prefix is not None and (prefix == "" or name.startswith(prefix + ".")):
                    found = i
                    break
            self._block_of[name] = found
        return self._block_of[name]

    def _arriving(self, name: str, *, write_back_others: bool = True) -> None:
        """Before ``name`` is loaded (everything before it is): materialize its block."""
        b = self._block(name)
        if b is None or self._scratch is None:
            return
        if write_back_others and self._by_order:
            self._write_back_except(b)
        self._scratch.materialize(b)

    def _write_back_except(self, keep: int | None) -> None:
        assert self._scratch is not None and self.session is not None
        for index in sorted(self._scratch.open):
            if index != keep:
                self._scratch.write_back(index, keep_previous=self.session.rollback)

    def _arrived(self, name: str) -> None:
        """``name`` has been loaded (its layer processed if it was the layer's last key)."""
        b = self._block(name)
        if b is None or name in self._seen or b not in self._remaining:
            return
        self._seen.add(name)
        self._remaining[b] -= 1
        if self._remaining[b] == 0 and self._scratch is not None and self.session is not None:
            self._scratch.write_back(b, keep_previous=self.session.rollback)

    def _tracked(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        # The session loads a generator one item at a time: when it asks for the next item, the previous
        # one is loaded, so its block may be written back.
        last = None
        for item in items:
            if last is not None:
                self._arrived(last)
            self._arriving(item[0])
            last = item[0]
            yield item
        if last is not None:
            self._arrived(last)

    # -- storage -------------------------------------------------------------------------------
    def _private_store(self) -> PackedStore:
        """The store as a private packed arena, moving off read-only mapped host weights first."""
        h = self.handle
        store = h.store
        if isinstance(store, PackedStore):
            return store
        assert store is not None and h.streamer is not None
        offsets, sizes = PackedStore.arena_plan(h.layouts, alignment=h.config.alignment_bytes, shard=None)
        need = offsets[-1] + sizes[-1]
        budget = h.config.update_host_budget_bytes
        limit = _mem_available_bytes() if budget is None else budget
        what = "update_host_budget_bytes" if budget is not None else "the host's MemAvailable"
        if need > limit:
            raise ConfigError(
                f"update refused before any write: the offloaded blocks' host weights are read-only "
                f"mappings ({h._metrics.host_weights_source}, {store.kind} storage), which are never "
                f"written; moving this rank to a private host arena needs {need} bytes, {what} is "
                f"{limit} bytes. Raise OffloadConfig.update_host_budget_bytes or load the host weights "
                "with the ordinary loader"
            )
        arena = torch.zeros(need, dtype=torch.uint8)
        for lay, off, size in zip(h.layouts, offsets, sizes):
            # Host -> host copies (the store's own packing), after the drain: nothing else reads them.
            store.copy_block(lay.index, arena[off : off + size])
        h.shim.synchronize()
        region = None
        try:
            region = register_region(arena, device=h.shim.device)
        except PinError as e:
            reason = f"the private host arena of the first update is pageable: {e}"
            logger.warning(reason)
            h._metrics.num_fallbacks += 1
            h._metrics.fallback_reasons += (reason,)
        packed = PackedStore(h.layouts, None, arena=arena, region=region, alignment=h.config.alignment_bytes)
        old_kind = store.kind
        store.close()  # unpins the mapping (pinned in place) or the staging buffers; the files stay
        h.store = packed
        h.streamer.submitter.store = packed
        m = h._metrics
        m.host_storage, m.host_bytes, m.mapped_bytes = packed.kind, packed.host_bytes, 0
        m.pinned_bytes = packed.pinned_bytes
        m.num_storage_moves += 1
        logger.info(
            "[rank %d] first update: %s host weights (%s) moved to a private %s arena of %.1f MB",
            h.gather.global_rank, m.host_weights_source, old_kind, "pinned" if region else "pageable",
            need / 1e6,
        )
        return packed
