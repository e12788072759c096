"""Data planes: how a packed bucket gets from the sender's buffer into every receiver's buffer.

Both planes run the same bucket loop (``acquire`` / pack / ``submit`` on the sender, ``wait`` / verify /
load / ``release`` on receivers) with ``num_buffers`` buffers used round robin, so bucket k+1 is packed
while bucket k is in flight and bucket k+1 is received while bucket k is loaded.

*Broadcast* (nccl, gloo): buckets travel by ``broadcast`` on the data group. On CUDA the sender packs on
a pack stream and broadcasts from a comm stream that waits for the packing event; receivers post the
receive of bucket k+n on the comm stream behind an event recorded after bucket k was loaded, so a buffer
is never overwritten while the engine still reads it. The host bounds the sender's run-ahead by waiting
for the broadcast that last used a buffer before packing into it again.

*Shared* (shm, ipc): the buffers are shared memory, so only small control messages travel, on the gloo
control group, in a fixed order that every rank issues identically: READY(0), RELEASE(0), READY(1),
RELEASE(1), ... READY(k) (a broadcast) says bucket k is complete in buffer k % n; RELEASE(k) (an
all-reduce MAX) says every receiver is done reading it and carries a failure flag, so the sender learns
of a receiver failure one bucket later and stops packing. The sender synchronizes its pack stream before
READY, and receivers synchronize their stream before RELEASE: the other process cannot see our stream.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from weight_sync.errors import TransportError
from weight_sync.layers.streams import DeviceShim
from weight_sync.transport.group import Channel, Deadline, poll
from weight_sync.transport.wire import MAGIC, STATUS_ABORT

__all__ = [
    "BroadcastReceiverPlane",
    "BroadcastSenderPlane",
    "SharedReceiverPlane",
    "SharedSenderPlane",
]


def _sync_stream(shim: DeviceShim, stream: Any, channel: Channel, phase: str) -> None:
    """Block the host until ``stream``'s work so far is done, with the channel's deadline (CUDA only)."""
    if not shim.is_cuda:
        return
    ev = shim.event()
    ev.record(stream)
    deadline = Deadline(channel.timeout_s)

    def timed_out() -> BaseException:
        from weight_sync.errors import TransportTimeout

        msg = f"[rank {channel.rank}] {phase}: the device did not finish within {deadline.timeout_s:.1f} s"
        channel.fail(msg)
        return TransportTimeout(msg)

    poll(ev.query, deadline, timed_out)


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
        self._works: list[tuple[int, Any] | None] = [None] * len(buffers)
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._seq, self._call = seq, call

    def acquire(self, k: int, i: int) -> bool:
        """Wait until buffer ``i`` may be overwritten. Returns whether a receiver reported failure (never
        known mid-call on this plane)."""
        prev = self._works[i]
        if prev is not None:
            self.channel.wait(prev[1], f"update_weights: broadcast of bucket {prev[0]}")
            self._works[i] = None
        return False

    def submit(self, k: int, i: int, wire_bytes: int, status: int) -> None:
        self._packed[i].record(self.pack_stream)
        # The broadcast must not read the buffer before the pack stream has written it.
        self.comm_stream.wait_event(self._packed[i])
        view = self.buffers[i][:wire_bytes]
        with self.comm_stream.use():
            work = self.channel.guard(
                f"update_weights: broadcast of bucket {k}", lambda: self.group.broadcast([view], self._opts)
            )
        self._works[i] = (k, work)

    def end_call(self) -> bool:
        for i, w in enumerate(self._works):
            if w is not None:
                self.channel.wait(w[1], f"update_weights: broadcast of bucket {w[0]}")
                self._works[i] = None
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
        self._works: list[tuple[int, Any] | None] = [None] * len(buffers)
        self._sizes: list[int] = []
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank = 0

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._sizes = wire_sizes
        for k in range(min(len(self.buffers), len(wire_sizes))):
            self._post(k, k % len(self.buffers))

    def _post(self, k: int, i: int) -> None:
        # The receive of bucket k overwrites buffer i: wait (on the device) until the engine finished
        # reading the bucket that occupied it, recorded by release().
        self.comm_stream.wait_event(self._freed[i])
        view = self.buffers[i][: self._sizes[k]]
        with self.comm_stream.use():
            work = self.channel.guard(
                f"update_weights: receive of bucket {k}", lambda: self.group.broadcast([view], self._opts)
            )
        self._works[i] = (k, work)

    def wait(self, k: int, i: int) -> int | None:
        """Block (with a deadline) until bucket ``k`` is in buffer ``i``; the trailer holds its status."""
        w = self._works[i]
        assert w is not None and w[0] == k, f"bucket {k} was not posted into buffer {i}"
        self.channel.wait(w[1], f"update_weights: receive of bucket {k} from the sender (rank 0)")
        self._works[i] = None
        return None

    def release(self, k: int, i: int, failed: bool) -> None:
        self._freed[i].record(self.shim.current_stream())
        nxt = k + len(self.buffers)
        if nxt < len(self._sizes):
            self._post(nxt, i)

    def end_call(self) -> None:
        for i, w in enumerate(self._works):
            if w is not None:
                self.channel.wait(w[1], f"update_weights: receive of bucket {w[0]}")
                self._works[i] = None


def _ready_record(seq: int, call: int, k: int, i: int, wire_bytes: int, status: int) -> torch.Tensor:
    return torch.tensor([MAGIC, seq, call, k, i, wire_bytes, status, 0], dtype=torch.int64)


class SharedSenderPlane:
    """Sender half of the shared-buffer plane (shm / ipc)."""

    def __init__(self, channel: Channel, buffers: list[torch.Tensor], shim: DeviceShim) -> None:
        self.channel = channel
        self.buffers = buffers
        self.shim = shim
        self.pack_stream = shim.stream()
        self._ready: dict[int, tuple[Any, torch.Tensor]] = {}
        self._release: dict[int, tuple[Any, torch.Tensor]] = {}

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._seq, self._call = seq, call
        self._ready.clear()
        self._release.clear()

    def _collect(self, k: int) -> bool:
        failed = False
        r = self._ready.pop(k, None)
        if r is not None:
            self.channel.wait(r[0], f"update_weights: READY of bucket {k}")
        rel = self._release.pop(k, None)
        if rel is not None:
            self.channel.wait(rel[0], f"update_weights: RELEASE of bucket {k} by the receivers")
            failed = bool(rel[1][0] > 0)
        return failed

    def acquire(self, k: int, i: int) -> bool:
        """Wait for every receiver to release the bucket that last used buffer ``i``."""
        return self._collect(k - len(self.buffers)) if k >= len(self.buffers) else False

    def submit(self, k: int, i: int, wire_bytes: int, status: int) -> None:
        # Receivers read the buffer from another process as soon as READY arrives: the packing must be
        # complete on the device first, not merely queued on our stream.
        _sync_stream(self.shim, self.pack_stream, self.channel, f"update_weights: packing of bucket {k}")
        rec = _ready_record(self._seq, self._call, k, i, wire_bytes, status)
        self._ready[k] = (self.channel.ibroadcast(rec, f"update_weights: READY of bucket {k}"), rec)
        flag = torch.zeros(1, dtype=torch.int64)
        self._release[k] = (self.channel.allreduce_max(flag, f"update_weights: RELEASE of bucket {k}"), flag)

    def end_call(self) -> bool:
        failed = False
        for k in sorted(set(self._ready) | set(self._release)):
            failed |= self._collect(k)
        return failed


class SharedReceiverPlane:
    """Receiver half of the shared-buffer plane (shm / ipc)."""

    def __init__(self, channel: Channel, buffers: list[torch.Tensor], shim: DeviceShim) -> None:
        self.channel = channel
        self.buffers = buffers
        self.shim = shim
        self._n = 0
        self._ready: tuple[int, Any, torch.Tensor] | None = None
        self._release: list[tuple[int, Any, torch.Tensor]] = []

    def begin_call(self, wire_sizes: list[int], seq: int, call: int) -> None:
        self._n = len(wire_sizes)
        self._sizes = wire_sizes
        self._seq, self._call = seq, call
        if self._n:
            self._post_ready(0)

    def _post_ready(self, k: int) -> None:
        rec = torch.zeros(8, dtype=torch.int64)
        self._ready = (k, self.channel.ibroadcast(rec, f"update_weights: READY of bucket {k}"), rec)

    def wait(self, k: int, i: int) -> int | None:
        assert self._ready is not None and self._ready[0] == k
        _, work, rec = self._ready
        self.channel.wait(work, f"update_weights: READY of bucket {k} from the sender (rank 0)")
        self._ready = None
        magic, seq, call, kk, ii, nbytes, status, _ = rec.tolist()
        expected = (MAGIC, self._seq, self._call, k, i, self._sizes[k])
        if (magic, seq, call, kk, ii, nbytes) != expected:
            msg = (f"[rank {self.channel.rank}] update_weights: READY record {rec.tolist()} does not match "
                   f"the expected (magic, seq, call, bucket, buffer, bytes) = {expected}")
            self.channel.fail(msg)
            raise TransportError(msg)
        return STATUS_ABORT if status == STATUS_ABORT else None

    def release(self, k: int, i: int, failed: bool) -> None:
        # The sender may overwrite the buffer as soon as RELEASE completes: finish reading it first.
        _sync_stream(self.shim, self.shim.current_stream(), self.channel,
                     f"update_weights: loading bucket {k}")
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        self._release.append((k, self.channel.allreduce_max(flag, f"update_weights: RELEASE of bucket {k}"), flag))
        # Keep at most one RELEASE outstanding; it completes once the sender joins it.
        while len(self._release) > 1:
            kk, w, _ = self._release.pop(0)
            self.channel.wait(w, f"update_weights: RELEASE of bucket {kk}")
        if k + 1 < self._n:
            self._post_ready(k + 1)

    def end_call(self) -> None:
        for kk, w, _ in self._release:
            self.channel.wait(w, f"update_weights: RELEASE of bucket {kk}")
        self._release.clear()
