"""Data planes: how a packed bucket gets from the sender's buffer into every receiver's buffer, and when a
buffer may be used again.

Both planes run the same bucket loop (``acquire`` / pack / ``submit`` on the sender, ``wait`` / check /
load / ``release`` on receivers) over ``n = num_buffers`` buffers used round robin. The rule on CUDA: the
host never waits for the device inside the loop, except to stay a bounded number of buckets ahead of it;
buffer reuse is ordered on the device with events, created once per connection.

*Broadcast* (nccl, gloo). Sender: bucket k is packed on the pack stream into buffer k % n after the pack
stream waited (on the device) for the buffer's 'sent' event, recorded behind the broadcast that last read
it; the comm stream waits for the packing event, issues the broadcast and records 'sent' behind it
(``work.wait()`` of an NCCL work makes the *current stream* wait, it does not block the host). So the
packing of bucket k+1 overlaps the broadcast of bucket k. The host stops only when it is ``2 n`` buckets
ahead of the completed broadcasts: that bounds the caller's tensors the pack stream still holds (a source
that casts or gathers on the fly allocates per tensor) and the depth of the launch queue.

Receivers post the receive of bucket k+n on the comm stream behind the buffer's 'freed' event, recorded
on the compute stream after the loads of bucket k, so the receive of bucket k+1 is in flight while bucket k
is loaded. In 'deferred' verification the compute stream waits for a receive on the device and the host
goes straight on to the checks and loads; it stops only when it is ``n`` buckets ahead of the completed
receives. That bound matters: kernels queued behind a receive that never completes (a dead sender) must
stay far below the driver's launch queue, or the host would block inside a launch, out of reach of every
deadline. In 'before_load' verification the host waits for each receive (the checks are read back).

On CPU (gloo) every wait is a host wait: gloo's threads read and write the buffers themselves.

*Shared* (shm, ipc). The buffers are shared memory; READY(k) / RELEASE(k) records travel over a doorbell
(one Unix socket per receiver, see ``doorbell``), not collectives. ipc: the sender records an
interprocess CUDA event after packing bucket k and sends READY(k) right away; the receiver's compute
stream waits for that event on the device. RELEASE(k) goes out once the receiver's loads of bucket k have
*completed* (an event polled while the receiver waits for its next READY; the device is never blocked):
so the trainer's streams never depend on an engine's GPU progress and a dying engine cannot wedge the
trainer. The sender waits for RELEASE(k - n) before packing bucket k into the same buffer; RELEASE
carries a failure flag, so the sender stops packing one bucket round after a receiver failed. shm: the
host packs and loads synchronously, and the socket publishes the stores to the other process.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from weight_sync.errors import TransportError, TransportTimeout
from weight_sync.layers.streams import DeviceShim, Stream
from weight_sync.transport.doorbell import Link
from weight_sync.transport.group import Channel, Deadline
from weight_sync.transport.wire import MAGIC, STATUS_ABORT

__all__ = [
    "BroadcastReceiverPlane",
    "BroadcastSenderPlane",
    "SharedReceiverPlane",
    "SharedSenderPlane",
]

T = TypeVar("T")


class _Works:
    """Issued collectives of one call, by bucket, completed on the host in bucket order."""

    def __init__(self, channel: Channel, what: str) -> None:
        self.channel = channel
        self.what = what
        self._works: dict[int, Any] = {}

    def add(self, k: int, work: Any) -> None:
        self._works[k] = work

    def get(self, k: int) -> Any:
        return self._works[k]

    def complete_through(self, k: float) -> None:
        """Wait (each with the channel's deadline) for every work of a bucket <= ``k``."""
        while self._works:
            first = next(iter(self._works))
            if first > k:
                return
            work = self._works.pop(first)
            self.channel.wait(work, f"update_weights: {self.what} of bucket {first}")

    def __len__(self) -> int:
        return len(self._works)


class BroadcastSenderPlane:
    """Sender half of the broadcast plane (rank 0 of the data group is the root)."""

    def __init__(self, channel: Channel, data_group: Any, buffers: list[torch.Tensor], shim: DeviceShim) -> None:
        self.channel = channel
        self.group = data_group
        self.buffers = buffers
        self.shim = shim
        # Created once per connection (a stream per call leaks; see DESIGN decision 12).
        self.pack_stream = shim.stream()
        self.comm_stream = shim.stream()
        self._packed = [shim.event() for _ in buffers]
        self._sent = [shim.event() for _ in buffers]
        self._works = _Works(channel, "broadcast")
        # CPU: gloo's thread reads buffer i until its broadcast completes, so the host must wait for it
        # before packing into the buffer again. CUDA: the device orders that; the host only keeps a
        # bounded lead.
        self.run_ahead = 2 * len(buffers) if shim.is_cuda else len(buffers)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._seq, self._call = seq, call

    def acquire(self, k: int, i: int) -> bool:
        """Make buffer ``i`` safe to pack into. Returns whether a receiver reported failure (never known
        mid-call on this plane)."""
        self._works.complete_through(k - self.run_ahead)
        if self.shim.is_cuda:
            # The pack stream must not overwrite buffer i before the broadcast that last read it is done.
            self.pack_stream.wait_event(self._sent[i])
        return False

    def submit(self, k: int, i: int, wire_bytes: int, status: int) -> None:
        self._packed[i].record(self.pack_stream)
        # The broadcast must not read the buffer before the pack stream has written it.
        self.comm_stream.wait_event(self._packed[i])
        view = self.buffers[i][:wire_bytes]
        phase = f"update_weights: broadcast of bucket {k}"
        with self.comm_stream.use():
            work = self.channel.guard(phase, lambda: self.group.broadcast([view], self._opts))
            if self.shim.is_cuda:
                # NCCL runs on its own stream: work.wait() makes the comm stream (current here) wait for
                # it without blocking the host, so 'sent' lands behind the broadcast itself.
                self.channel.guard(phase, work.wait)
                self._sent[i].record(self.comm_stream)
        self._works.add(k, work)

    def end_call(self) -> bool:
        self._works.complete_through(float("inf"))
        return False


class BroadcastReceiverPlane:
    """Receiver half of the broadcast plane."""

    def __init__(self, channel: Channel, data_group: Any, buffers: list[torch.Tensor], shim: DeviceShim) -> None:
        self.channel = channel
        self.group = data_group
        self.buffers = buffers
        self.shim = shim
        self.comm_stream = shim.stream()
        self._freed = [shim.event() for _ in buffers]
        self._works = _Works(channel, "receive")
        self._sizes: list[int] = []
        self._compute: Stream | None = None
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._sizes = wire_sizes
        self._compute = self.shim.current_stream()  # where the engine's loads run during this call
        for k in range(min(len(self.buffers), len(wire_sizes))):
            self._post(k, k % len(self.buffers))

    def _post(self, k: int, i: int) -> None:
        # The receive of bucket k overwrites buffer i: it waits (on the device) until the engine finished
        # reading the bucket that occupied it, recorded by release().
        self.comm_stream.wait_event(self._freed[i])
        view = self.buffers[i][: self._sizes[k]]
        with self.comm_stream.use():
            work = self.channel.guard(
                f"update_weights: receive of bucket {k}", lambda: self.group.broadcast([view], self._opts)
            )
        self._works.add(k, work)

    def wait(self, k: int, i: int, host: bool = True) -> int | None:
        """Make bucket ``k`` in buffer ``i`` visible to the compute stream (``host``: and to the host).

        Its status is in the trailer (this plane has no side channel), so this returns None.
        """
        if host or not self.shim.is_cuda:
            # Host wait with a deadline; for NCCL it also makes the current stream wait for the receive.
            self._works.complete_through(k)
            return None
        # Flow control: stay at most n buckets ahead of the completed receives (see the module docstring).
        self._works.complete_through(k - len(self.buffers))
        work = self._works.get(k)
        # The compute stream waits for the receive on the device; the host goes on to queue the loads.
        self.channel.guard(f"update_weights: receive of bucket {k}", work.wait)
        return None

    def release(self, k: int, i: int, failed: bool) -> None:
        self._freed[i].record(self._compute)
        nxt = k + len(self.buffers)
        if nxt < len(self._sizes):
            self._post(nxt, i)

    def end_call(self) -> None:
        self._works.complete_through(float("inf"))


def _ready_record(seq: int, call: int, k: int, i: int, wire_bytes: int, status: int) -> tuple[int, ...]:
    return (MAGIC, seq, call, k, i, wire_bytes, status, 0)


def _release_record(seq: int, call: int, k: int, failed: bool) -> tuple[int, ...]:
    return (MAGIC, seq, call, k, 1 if failed else 0, 0, 0, 0)


def _on_link(channel: Channel, fn: Callable[..., T], *args: Any) -> T:
    """Run a doorbell operation; a dead or silent peer breaks the channel (and closes every link)."""
    try:
        return fn(*args)
    except TransportError as e:
        msg = f"[rank {channel.rank}] {e}"
        channel.fail(msg)
        raise (TransportTimeout if isinstance(e, TransportTimeout) else TransportError)(msg) from e


def _recv_counted(channel: Channel, link: Link, deadline: Deadline, phase: str) -> tuple[int, ...]:
    rec = _on_link(channel, link.try_recv, phase)
    if rec is None:
        rec = _on_link(channel, link.recv, deadline, phase)
        channel.count("link", blocked=True)
    else:
        channel.count("link")
    return rec


class SharedSenderPlane:
    """Sender half of the shared-buffer plane (shm / ipc)."""

    def __init__(self, channel: Channel, links: dict[int, Link], buffers: list[torch.Tensor], shim: DeviceShim,
                 events: list[Any] | None = None) -> None:
        self.channel = channel
        self.links = [links[r] for r in sorted(links)]
        self.buffers = buffers
        self.shim = shim
        self.pack_stream = shim.stream()
        self.events = events  # ipc: one interprocess CUDA event per buffer, recorded after its packing
        self._n = 0
        self._next_release = 0

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._seq, self._call = seq, call
        self._n = len(wire_sizes)
        self._next_release = 0

    def _collect_through(self, k: int) -> bool:
        """Read every receiver's RELEASE of each bucket <= ``k`` not read yet; returns any failure flag."""
        failed = False
        while self._next_release <= k:
            kk = self._next_release
            phase = f"update_weights: RELEASE of bucket {kk}"
            deadline = Deadline(self.channel.timeout_s)
            for link in self.links:
                rec = _recv_counted(self.channel, link, deadline, phase)
                if rec[:4] != (MAGIC, self._seq, self._call, kk):
                    msg = (f"[rank 0] {phase}: {link.peer} sent {list(rec)}, expected (magic, update, call, "
                           f"bucket) = {(MAGIC, self._seq, self._call, kk)}")
                    self.channel.fail(msg)
                    raise TransportError(msg)
                failed |= rec[4] != 0
            self._next_release += 1
        return failed

    def acquire(self, k: int, i: int) -> bool:
        """Wait until every receiver released the bucket that last used buffer ``i`` (in this call; the
        previous call's end_call collected all of its releases)."""
        return self._collect_through(k - len(self.buffers))

    def submit(self, k: int, i: int, wire_bytes: int, status: int) -> None:
        if self.events is not None:
            # ipc: READY goes out without waiting for the packing; the receiver's compute stream waits for
            # this event on the device. The event is recorded again (bucket k + n) only after every
            # receiver's RELEASE(k), i.e. after each receiver issued its wait for this recording.
            self.events[i].record(self.pack_stream.raw)
        # shm: the host packed the buffer synchronously; send() publishes those stores to the receivers.
        rec = _ready_record(self._seq, self._call, k, i, wire_bytes, status)
        phase = f"update_weights: READY of bucket {k}"
        deadline = Deadline(self.channel.timeout_s)
        for link in self.links:
            _on_link(self.channel, link.send, rec, deadline, phase)

    def end_call(self) -> bool:
        return self._collect_through(self._n - 1)


class SharedReceiverPlane:
    """Receiver half of the shared-buffer plane (shm / ipc)."""

    def __init__(self, channel: Channel, link: Link | None, buffers: list[torch.Tensor], shim: DeviceShim,
                 events: list[Any] | None = None) -> None:
        self.channel = channel
        self.link = link
        self.buffers = buffers
        self.shim = shim
        self.events = events  # ipc: the sender's packing events, imported once
        self._freed = [shim.event() for _ in buffers]
        self._pending: deque[tuple[int, bool]] = deque()  # loads queued, RELEASE not sent yet
        self._n = 0
        self._sizes: list[int] = []
        self._compute: Stream | None = None

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._n = len(wire_sizes)
        self._sizes = wire_sizes
        self._seq, self._call = seq, call
        self._compute = self.shim.current_stream()

    def _send_releases(self, block: bool) -> None:
        """Send RELEASE for every bucket whose loads completed, in order (``block``: all of them)."""
        assert self.link is not None
        link = self.link
        while self._pending:
            k, failed = self._pending[0]
            # freed[k % n] is still bucket k's recording: it is recorded again only for bucket k + n, whose
            # READY needs this RELEASE first.
            ev = self._freed[k % len(self.buffers)]
            if not ev.query():
                if not block:
                    return
                self.channel.wait_event(ev, f"update_weights: loading bucket {k}")
            self._pending.popleft()
            rec = _release_record(self._seq, self._call, k, failed)
            deadline = Deadline(self.channel.timeout_s)
            _on_link(self.channel, link.send, rec, deadline, f"update_weights: RELEASE of bucket {k}")

    def _await_ready(self, k: int) -> tuple[int, ...]:
        assert self.link is not None
        link = self.link
        phase = f"update_weights: READY of bucket {k} from the sender (rank 0)"
        deadline = Deadline(self.channel.timeout_s)
        start = time.monotonic()
        blocked = False
        while True:
            self._send_releases(block=False)
            rec = _on_link(self.channel, link.try_recv, phase)
            if rec is not None:
                self.channel.count("link", blocked)
                return rec
            blocked = True
            if deadline.expired():
                msg = f"[rank {self.channel.rank}] {phase}: no progress within {deadline.timeout_s:.1f} s"
                self.channel.fail(msg)
                raise TransportTimeout(msg)
            if self._pending:
                # Wake up on the record at once, or after a short while to check the loads' events
                # (a tenth of the time waited so far, as in group.poll).
                waited = time.monotonic() - start
                link.readable(min(0.002, max(2e-5, 0.1 * waited)))
            else:
                link.readable(min(deadline.remaining(), 0.5))

    def wait(self, k: int, i: int, host: bool = True) -> int | None:
        rec = self._await_ready(k)
        magic, seq, call, kk, ii, nbytes, status, _ = rec
        expected = (MAGIC, self._seq, self._call, k, i, self._sizes[k])
        if (magic, seq, call, kk, ii, nbytes) != expected:
            msg = (f"[rank {self.channel.rank}] update_weights: READY record {list(rec)} does not match "
                   f"the expected (magic, seq, call, bucket, buffer, bytes) = {expected}")
            self.channel.fail(msg)
            raise TransportError(msg)
        if self.events is not None:
            assert self._compute is not None and self._compute.raw is not None
            # The sender recorded this event after packing bucket k and before sending READY(k): waiting
            # for it now waits for exactly that packing (the sender records it again only after our
            # RELEASE(k)). The host does not block; a 'before_load' check reads back behind this wait.
            self._compute.raw.wait_event(self.events[i])
            if host:
                # The host must see the bytes too (checks read back per bucket, or a blocking copy of the
                # session): wait for the packing here, with the deadline.
                self.channel.wait_event(self.events[i], f"update_weights: packing of bucket {k} by the sender (rank 0)",
                                        "the sender's device")
        return STATUS_ABORT if status == STATUS_ABORT else None

    def release(self, k: int, i: int, failed: bool) -> None:
        self._freed[i].record(self._compute)
        self._pending.append((k, failed))
        self._send_releases(block=False)

    def end_call(self) -> None:
        # Every RELEASE of the call goes out (after its loads completed) before the status exchange: the
        # sender's next call packs into buffer 0 without another wait.
        self._send_releases(block=True)
