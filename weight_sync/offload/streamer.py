"""The block streamer: two device slots, forward hooks, and the prefetch ring.

The hook before block i (compute thread):
  1. takes the load of block i that the previous hook queued (or queues it now: first block of the first
     step, or a ring that was not predicted), waits until it is *submitted*, and makes the compute stream
     wait on its ``ready`` event - the CPU never waits for the device;
  2. re-points block i's parameters and buffers to views of its slot (built once per slot, strides
     preserved);
  3. queues the load of the ring's next block (the last block's next is the ring's first, which the next
     denoising step runs first) into the other slot.
The hook after block i records ``free[slot]`` on the compute stream: once the device passes that point,
the slot may be overwritten.

Loads alternate slots by a running sequence number, not by block index, so odd rings and mispredicted
rings stay correct. Nothing on this path allocates device memory or synchronizes the device.

Device memory for streamed blocks is allocated once, here: two slots (the largest block, padded) and,
with ``landing_buffers`` (``dlo_landing_buffers`` while AllGather is active), two landing buffers of one
shard of the largest block each. In place, a block's shard is copied straight into its slot, so the copy
of block i+2 waits for compute of block i to leave the slot; with landing buffers the shard is copied
into a landing buffer and gathered out of place into the slot, and only the (short) gather waits for the
slot. See ``weight_sync.offload.submitter`` for the stream protocol of both modes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from weight_sync.errors import WeightSyncError
from weight_sync.layers import DeviceShim
from weight_sync.offload.gather_group import GatherGroup
from weight_sync.offload.host_store import HostStore
from weight_sync.offload.layout import BlockLayout, slot_views
from weight_sync.offload.metrics import OffloadMetrics, Trace
from weight_sync.offload.submitter import LoadJob, SlotEvents, Submitter

__all__ = ["BlockStreamer"]


class BlockStreamer:
    """Streams the blocks of ``layouts`` through two device slots; ``attach`` installs the hooks."""

    def __init__(
        self,
        *,
        layouts: Sequence[BlockLayout],
        rings: Sequence[Sequence[int]],
        modules: Sequence[nn.Module],
        store: HostStore,
        gather: GatherGroup,
        shim: DeviceShim,
        metrics: OffloadMetrics,
        trace: Trace | None,
        timeout_s: float,
        landing_buffers: bool = False,
    ) -> None:
        self.layouts, self.modules, self.shim = list(layouts), list(modules), shim
        self.metrics, self.trace = metrics, trace
        slot_bytes = max(lay.padded_bytes if gather.active else lay.nbytes for lay in layouts)
        # The only device memory offload allocates for streamed blocks: two slots, once (plus, with
        # landing buffers, two buffers of one shard each).
        self.slots = [torch.zeros(slot_bytes, dtype=torch.uint8, device=shim.device) for _ in range(2)]
        self.landing: list[torch.Tensor] = []
        if landing_buffers and gather.active:
            landing_bytes = max(lay.shard_bytes for lay in layouts)
            self.landing = [
                torch.zeros(landing_bytes, dtype=torch.uint8, device=shim.device) for _ in range(2)
            ]
            metrics.landing_bytes = landing_bytes
            metrics.num_landing_buffers_allocated += 2
        # The zero fills run on the compute stream; the copy stream's first write must not race them.
        shim.synchronize()
        metrics.slot_bytes = slot_bytes
        metrics.num_slots_allocated += 2
        self.views = [[slot_views(lay, slot) for slot in self.slots] for lay in self.layouts]
        self.next_of: dict[int, int] = {}
        for ring in rings:
            for k, index in enumerate(ring):
                self.next_of[index] = ring[(k + 1) % len(ring)]
        self.events = SlotEvents(shim)
        self.submitter = Submitter(
            shim=shim, store=store, layouts=self.layouts, gather=gather, events=self.events,
            metrics=metrics, trace=trace, timeout_s=timeout_s, landing=self.landing,
        )
        self._seq = 0
        self._pending: dict[int, tuple[int, int]] = {}  # block -> (seq, slot) queued, not yet consumed
        self._running: dict[int, tuple[int, Any]] = {}  # block -> (slot, compute trace mark)
        self._hooks: list[Any] = []
        # Called before every block forward (``weight_sync.offload.update`` sets it once the model has
        # been updated: a forward during an open update, or on a torn model, is refused there).
        self.before_block: Any = None

    @property
    def num_loads_issued(self) -> int:
        """Loads queued so far, prefetches and restores included (equal on ranks that ran alike)."""
        return self._seq

    def attach(self) -> None:
        for index in self.next_of:
            module = self.modules[index]
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._pre, index)))
            self._hooks.append(module.register_forward_hook(functools.partial(self._post, index)))

    def _queue_load(self, index: int) -> tuple[int, int]:
        seq = self._seq
        self._seq += 1
        slot = seq % 2
        self.submitter.submit(LoadJob(seq, index, self.slots[slot], slot))
        self._pending[index] = (seq, slot)
        return seq, slot

    def _pre(self, index: int, module: nn.Module, args: Any) -> None:
        if self.before_block is not None:
            self.before_block()  # raises before anything is queued or re-pointed
        entry = self._pending.pop(index, None)
        if entry is None:
            # Not the block we prefetched: the stale load is simply never consumed; the copy stream's
            # wait on ready[slot] keeps the next writer of that slot behind it.
            self._pending.clear()
            self.metrics.num_prefetch_misses += 1
            entry = self._queue_load(index)
            del self._pending[index]
        seq, slot = entry
        self.submitter.wait_submitted(seq)
        self.events.ready[slot].wait()  # compute stream waits for the weights; the CPU does not
        for p, view in zip(self.layouts[index].placements, self.views[index][slot]):
            # .data swaps storage under the same object: hooks, closures and kernels that captured
            # the Parameter keep working; the view keeps the tensor's original strides.
            p.tensor.data = view
        mark = self.trace.begin() if self.trace else None
        self._running[index] = (slot, mark)
        self.metrics.num_block_loads += 1
        nxt = self.next_of[index]
        if nxt not in self._pending:
            self._queue_load(nxt)

    def _post(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        running = self._running.pop(index, None)
        if running is None:
            raise WeightSyncError(f"{self.layouts[index].name}: forward hook ran without its pre-hook")
        slot, mark = running
        if self.trace:
            self.trace.end("compute", self.layouts[index].name, mark)
        self.events.free[slot].record()

    def load_into(self, index: int, dst: torch.Tensor) -> None:
        """Load block ``index`` into ``dst`` and wait for it (used when restoring the resident model).

        Runs through the submission thread, so collectives keep the order every rank shares.
        """
        seq = self._seq
        self._seq += 1
        self.submitter.submit(LoadJob(seq, index, dst, None))
        self.submitter.wait_submitted(seq)

    def drain(self) -> None:
        """Wait until every queued load is done and forget the prefetched ones (weights will change).

        A prefetch queued by the last block of a forward holds the old bytes of the ring's next block;
        the next forward must load that block again. Stale loads are never consumed, as after a
        prefetch miss, and waiting for them here means no copy reads host storage while it is written.
        """
        if self._seq:
            self.submitter.wait_submitted(self._seq - 1)
        self.shim.synchronize()
        self._pending.clear()

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def close(self) -> None:
        self.detach()
        self.submitter.close()
        self._pending.clear()
        self.slots.clear()
        self.landing.clear()
        self.submitter.landing.clear()
        self.views.clear()
