"""The submission thread: one per rank, it issues every block transfer (H2D, then AllGather) in order.

Why a thread: the compute thread must never block on a copy or a collective, and every rank of a gather
group must issue its collectives in the same order. One thread consuming one FIFO gives both: the
compute thread enqueues load jobs in block order and continues; this thread turns each job into stream
work. The compute thread later waits only until a job has been *submitted* (its ``ready`` event
recorded), never for the device to finish it: the device-side wait is an event wait on the compute
stream.

Stream protocol. Events are allocated once, two per kind: ``ready[s]`` (slot s holds its block),
``free[s]`` (compute finished reading slot s), ``h2d[k]`` (the copy a job issued finished) and, with
landing buffers, ``consumed[k]`` (the gather that read landing buffer k finished).

In place (no AllGather, or AllGather without landing buffers), a load of block b into slot s:

    copy stream:  wait free[s]   (compute finished reading the slot's previous block)
                  wait ready[s]  (the previous load into s, including its gather, finished writing)
                  H2D host -> slot (with AllGather: this rank's shard, into its own 1/group region)
                  record h2d[s]
    comm stream:  wait h2d[s]; AllGather(slot) in place on the dedicated communicator; record ready[s]
    (no AllGather: ready[s] is recorded on the copy stream right after the H2D)

With landing buffers (``dlo_landing_buffers``, AllGather active), load number n (block b, slot s) uses
landing buffer k = n % 2 (two device buffers of one shard each, allocated once next to the slots):

    copy stream:  wait consumed[k]  (the gather that last read landing[k] finished)
                  H2D host shard -> landing[k]
                  record h2d[k]
    comm stream:  wait h2d[k]; wait free[s]  (the previous load into s recorded ready[s] earlier on this
                  same stream, so its gather is already ordered before this one)
                  AllGather(slot <- landing[k]) out of place; record ready[s]; record consumed[k]

Why landing buffers help. In place, the shard H2D of block b+2 writes into the slot that block b uses, so
it starts only once compute of b is done; the gather follows the copy and compute of b+2 follows the
gather. The critical cycle over two blocks is C + H + G (compute, shard H2D, gather per block): about
(C + H + G) / 2 per block, although the copy engine and the SMs could each keep pace alone. With landing
buffers only the gather (G, short, over NVLink) waits for the slot; the copy waits only for the gather of
two loads back, so the copy engine runs ahead and the pace per block tends to max(C, H). The cost is
two shards of device memory (``landing_bytes`` in the metrics). Restore loads (``slot`` None) always
run in place.

``free[s]`` is recorded by the compute thread after the block that used slot s, *before* the job that
overwrites s is queued, so the stream that waits on it waits on an event that was already recorded: a
wait on an event recorded later would silently not wait. ``h2d[k]`` and ``consumed[k]`` are recorded and
waited on by this thread only, in job order, so the same holds for them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weight_sync.errors import TransportTimeout, WeightSyncError
from weight_sync.layers import DeviceShim, Event
from weight_sync.offload.gather_group import GatherGroup, all_gather_bytes
from weight_sync.offload.host_store import HostStore
from weight_sync.offload.layout import BlockLayout
from weight_sync.offload.metrics import OffloadMetrics, Trace

__all__ = [
    "LoadJob",
    "SlotEvents",
    "Submitter",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadJob:
    """Load block ``index`` into ``dst``; ``slot`` None marks a one-off (restore) load run to completion."""

    seq: int
    index: int
    dst: torch.Tensor
    slot: int | None


class SlotEvents:
    """The events, created once, two of each: ready (weights landed), free (compute done), h2d (copy
    done) and consumed (landing buffer read by its gather; used with landing buffers only)."""

    def __init__(self, shim: DeviceShim) -> None:
        self.ready: list[Event] = [shim.event(), shim.event()]
        self.free: list[Event] = [shim.event(), shim.event()]
        self.h2d: list[Event] = [shim.event(), shim.event()]
        self.consumed: list[Event] = [shim.event(), shim.event()]


class Submitter:
    """Owns the copy and comm streams and the thread that issues transfers on them."""

    def __init__(
        self,
        *,
        shim: DeviceShim,
        store: HostStore,
        layouts: Sequence[BlockLayout],
        gather: GatherGroup,
        events: SlotEvents,
        metrics: OffloadMetrics,
        trace: Trace | None,
        timeout_s: float,
        landing: Sequence[torch.Tensor] = (),
    ) -> None:
        self.shim, self.store, self.layouts = shim, store, list(layouts)
        self.gather, self.events, self.metrics, self.trace = gather, events, metrics, trace
        if landing and (len(landing) != 2 or not gather.active):
            raise WeightSyncError("landing buffers come in pairs and need an active gather group")
        self.landing = list(landing)  # two device buffers of one shard each, or empty (in place)
        self.timeout_s = timeout_s
        self.copy_stream = shim.stream()
        self.comm_stream = shim.stream()
        self._queue: queue.SimpleQueue[LoadJob | None] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._done_seq = -1
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._loop, name=f"dlo-submit-rank{gather.global_rank}", daemon=True
        )
        self._thread.start()

    # -- compute-thread side ---------------------------------------------------------------------
    def submit(self, job: LoadJob) -> None:
        self._raise_if_failed()
        self._queue.put(job)

    def wait_submitted(self, seq: int) -> None:
        """Block until job ``seq`` has been issued to its streams (on CPU: has completed)."""
        with self._cond:
            if self._done_seq < seq and self._error is None:
                # Bounded: a transfer that is never submitted (a peer died inside a collective) must
                # surface as an error, not a hang.
                self._cond.wait_for(
                    lambda: self._done_seq >= seq or self._error is not None, timeout=self.timeout_s
                )
            self._raise_if_failed()
            if self._done_seq < seq:
                raise TransportTimeout(
                    f"[rank {self.gather.global_rank}] DLO load #{seq} was not submitted within "
                    f"{self.timeout_s:.0f} s (a peer of the gather group may have stopped)"
                )

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self.timeout_s)
        self.shim.synchronize()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise WeightSyncError(
                f"[rank {self.gather.global_rank}] the DLO submission thread failed: {self._error!r}"
            ) from self._error

    # -- submission-thread side ------------------------------------------------------------------
    def _loop(self) -> None:
        if self.shim.is_cuda:
            # The current device is per thread; streams and collectives below must target ours.
            torch.cuda.set_device(self.shim.device)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                with torch.no_grad():
                    self._run(job)
            except BaseException as e:
                logger.exception(
                    "[rank %d] DLO transfer of block %d failed", self.gather.global_rank, job.index
                )
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                self._done_seq = job.seq
                self._cond.notify_all()

    def _run(self, job: LoadJob) -> None:
        if self.landing and job.slot is not None:
            self._run_landed(job, job.slot)
            return
        lay = self.layouts[job.index]
        g = self.gather
        size = lay.shard_bytes if g.active else lay.nbytes
        own = job.dst[g.rank * size : (g.rank + 1) * size] if g.active else job.dst[:size]
        ev, s = self.events, job.slot
        with self.copy_stream.use():
            if s is not None:
                self.copy_stream.wait_event(ev.free[s])
                self.copy_stream.wait_event(ev.ready[s])
            mark = self.trace.begin() if self.trace else None
            self.metrics.h2d_bytes += self.store.copy_block(job.index, own)
            if self.trace:
                self.trace.end("h2d", lay.name, mark)
            if s is None:
                self.copy_stream.synchronize()
            elif g.active:
                ev.h2d[s].record(self.copy_stream)
            else:
                ev.ready[s].record(self.copy_stream)
        if not g.active:
            return
        with self.comm_stream.use():
            if s is not None:
                self.comm_stream.wait_event(ev.h2d[s])
            mark = self.trace.begin() if self.trace else None
            work = all_gather_bytes(job.dst[: lay.padded_bytes], own, g.group, async_op=True)
            # NCCL: makes the comm stream wait for the communicator's stream (no CPU block).
            # gloo: blocks this thread until the bytes arrived, which is what CPU needs.
            work.wait()
            if self.trace:
                self.trace.end("allgather", lay.name, mark)
            if s is None:
                self.comm_stream.synchronize()
            else:
                ev.ready[s].record(self.comm_stream)
        self.metrics.fabric_bytes += lay.padded_bytes - size
        self.metrics.num_gathers += 1

    def _run_landed(self, job: LoadJob, s: int) -> None:
        """Landing-buffer load: H2D into landing[k], then an out-of-place gather into slot ``s``."""
        lay = self.layouts[job.index]
        ev, k = self.events, job.seq % 2
        landing = self.landing[k][: lay.shard_bytes]
        with self.copy_stream.use():
            # Only the gather that last read landing[k] must be done - not compute on the slot.
            self.copy_stream.wait_event(ev.consumed[k])
            mark = self.trace.begin() if self.trace else None
            self.metrics.h2d_bytes += self.store.copy_block(job.index, landing)
            if self.trace:
                self.trace.end("h2d", lay.name, mark)
            ev.h2d[k].record(self.copy_stream)
        with self.comm_stream.use():
            self.comm_stream.wait_event(ev.h2d[k])
            # Compute finished reading the slot's previous block; the previous load into the slot
            # (its ready[s]) was recorded earlier on this stream, so it is ordered before this gather.
            self.comm_stream.wait_event(ev.free[s])
            mark = self.trace.begin() if self.trace else None
            work = all_gather_bytes(job.dst[: lay.padded_bytes], landing, self.gather.group, async_op=True)
            work.wait()  # NCCL: a stream wait (no CPU block); gloo: blocks this thread until done
            if self.trace:
                self.trace.end("allgather", lay.name, mark)
            ev.ready[s].record(self.comm_stream)
            ev.consumed[k].record(self.comm_stream)
        self.metrics.fabric_bytes += lay.padded_bytes - lay.shard_bytes
        self.metrics.num_gathers += 1
