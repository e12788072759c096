"""Rendezvous and process groups of one transport: a TCPStore, a gloo control group, a data group.

The sender hosts a TCPStore on a port the OS picks; receivers join it as clients. Groups are built
directly on prefixed views of that store (``ProcessGroupGloo`` / ``ProcessGroupNCCL(store, rank, size)``),
independent of either side's default process group. The control group (gloo, CPU tensors) carries JSON
headers and status records (for shm / ipc only until connect: then each receiver's control socket does,
see ``Channel.use_links``); the data group (nccl or gloo) carries buckets.

Every wait polls the operation against a deadline instead of blocking inside a collective, so a dead or
stuck peer surfaces as :class:`TransportTimeout` naming the phase and peer. After any communication
failure the channel is *broken*: a collective may be half-matched, so no further operation is attempted
and the transport must be connected again.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from weight_sync.errors import TransportError, TransportTimeout
from weight_sync.transport.wire import STATUS_SLOT_BYTES, RankStatus

__all__ = ["Channel", "Deadline", "host_store", "join_store", "make_group", "poll"]

# Control messages (headers) travel in one broadcast of this many bytes (an 8-byte length, then the first
# bytes of the message); only a longer message (a manifest) needs a second broadcast for the rest.
INLINE_BYTES = 4096
_RECORD_LEN = struct.Struct("<q")  # a status record's length in a status list sent over control links
_MAX_MESSAGE_BYTES = 1 << 31

log = logging.getLogger(__name__)


class Deadline:
    """A point in time a wait must not pass; ``remaining()`` in seconds (never negative)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def poll(done: Callable[[], bool], deadline: Deadline, on_timeout: Callable[[], BaseException]) -> bool:
    """Wait until ``done()`` is true; raise ``on_timeout()`` at the deadline. Returns whether it waited.

    The first ~50 us only yield (a bucket often completes within microseconds of the check); after that
    the sleep grows with the time already waited (a tenth of it, 20 us .. 2 ms), so a wait overshoots its
    event by at most ~10% (short waits on the hot path stay short) while a long idle wait costs no CPU.
    """
    if done():
        return False
    start = time.monotonic()
    while not done():
        if deadline.expired():
            raise on_timeout()
        waited = time.monotonic() - start
        time.sleep(0 if waited < 5e-5 else min(0.002, max(2e-5, 0.1 * waited)))
    return True


# A gloo wait blocks in slices this long (the GIL released): it wakes the moment the work completes, and
# between slices the deadline (and a KeyboardInterrupt) is checked.
_BLOCK_SLICE_S = 0.05


def wait_gloo(work: Any, deadline: Deadline, on_timeout: Callable[[], BaseException]) -> bool:
    """Wait for a gloo work by blocking on it (no polling overshoot); returns whether it waited.

    ``work.wait(timeout)`` raises "timed out" when a slice ends before the work does and leaves the work
    pending, so the wait resumes; any other error, or an error of the completed work, propagates.
    """
    if work.is_completed():
        return False
    while True:
        try:
            work.wait(timedelta(seconds=max(1e-3, min(_BLOCK_SLICE_S, deadline.remaining()))))
            return True
        except RuntimeError as e:
            if work.is_completed():
                # The work completed between the slice's end and this check (a loaded host shows it): the
                # slice's "timed out" is stale, so the work's own result (success or its error) decides.
                work.wait()
                return True
            if "timed out" not in str(e).lower():
                raise
        if deadline.expired():
            raise on_timeout()


def node_address() -> str:
    """This node's IP as Ray sees it when Ray is running, else the host name's address (or loopback).

    Ray is looked up only if the caller already imported it: weight_sync never imports ray itself.
    """
    import socket
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """Start the rendezvous store (port 0 lets the OS pick a free port)."""
    try:
        return dist.TCPStore(host, port, None, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as e:
        raise TransportError(f"cannot start the rendezvous store on {host}:{port}: {e}") from e


def join_store(address: str, timeout_s: float) -> dist.TCPStore:
    """Connect to the sender's rendezvous store at ``host:port``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransportError(f"transport address must be 'host:port', got {address!r}")
    try:
        return dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise TransportError(f"cannot reach the sender's rendezvous store at {address}: {e}") from e


def make_group(kind: str, store: dist.Store, prefix: str, rank: int, size: int, timeout_s: float) -> Any:
    """A gloo or NCCL group of ``size`` ranks on ``store`` under ``prefix`` (no default group needed)."""
    pstore = dist.PrefixStore(prefix, store)
    if kind == "gloo":
        # Longer than our own deadline, so that our poll (which names phase and peer) fires first.
        return dist.ProcessGroupGloo(pstore, rank, size, timedelta(seconds=1.5 * timeout_s + 1.0))
    if kind == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        # Our own polls time out first and abort the communicator; NCCL's watchdog is only a backstop
        # (when it fires it may tear the process down, so it must never be the first to notice).
        with contextlib.suppress(AttributeError):  # older torch: its default (10 min) is a backstop too
            opts._timeout = timedelta(seconds=max(4 * timeout_s, 60.0))
        # NCCL kernels need SMs like any kernel: on a normal-priority stream a broadcast queued behind
        # (or next to) the engine's processing kernels waits for their blocks to drain, and the wire
        # idles. A high-priority stream gets the next free SMs first.
        opts.is_high_priority_stream = True
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    raise ValueError(f"group kind must be 'gloo' or 'nccl', got {kind!r}")


def abort_group(group: Any) -> None:
    """Abort a group after a failure so that stuck kernels and threads exit (best effort)."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
            except Exception as e:
                log.debug("abort of a broken group via %s failed: %s", name, e)
            return


class Channel:
    """The control group of one transport plus the bookkeeping that makes failures agreed and loud.

    ``peer_of(phase)`` names who a wait depends on (the sender for receivers, the receivers for the
    sender); once broken, every call raises the original failure.
    """

    def __init__(self, group: Any, rank: int, size: int, timeout_s: float, peers: str) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.timeout_s = timeout_s
        self.peers = peers
        self.broken: str | None = None
        self._groups: list[Any] = [group]
        self._on_fail: list[Callable[[], None]] = []
        self._inline = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
        self._inline_np = self._inline.numpy()
        # The status all-gather's slots, allocated once and written / read through numpy views: encoding
        # and decoding through fresh tensors cost more host time than the collective's own latency.
        self._status_mine = torch.zeros(STATUS_SLOT_BYTES, dtype=torch.uint8)
        self._status_out = [torch.zeros(STATUS_SLOT_BYTES, dtype=torch.uint8) for _ in range(size)]
        self._status_np = self._status_mine.numpy()
        self._status_out_np = [t.numpy() for t in self._status_out]
        self._status_len = 0  # bytes of the last record written into ``_status_mine``
        # Control links (use_links): rank 0's to each receiver, or a receiver's to rank 0, by peer rank.
        self._links: dict[int, Any] | None = None
        # Host waits of this rank, for benchmarks and tests: 'comm' (a collective's completion), 'device'
        # (an event on a CUDA stream), 'readback' (a device->host read of values), 'link' (a doorbell
        # record), 'control' (a header or status exchange), 'blocked' (waits that found the operation
        # still running, i.e. the host actually stopped).
        self.stats: dict[str, int] = {"comm": 0, "device": 0, "readback": 0, "link": 0, "control": 0, "blocked": 0}

    def add_group(self, group: Any) -> None:
        self._groups.append(group)

    def on_fail(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the channel breaks (e.g. close doorbell links so that peers see EOF at once)."""
        self._on_fail.append(fn)

    def count(self, kind: str, blocked: bool = False) -> None:
        self.stats[kind] += 1
        if blocked:
            self.stats["blocked"] += 1

    def check(self) -> None:
        if self.broken is not None:
            raise TransportError(
                f"[rank {self.rank}] the transport is broken since an earlier failure ({self.broken}); "
                "connect a new sender and receivers"
            )

    def fail(self, reason: str) -> None:
        """Mark the channel broken and abort its groups (no further collective can be trusted)."""
        if self.broken is None:
            self.broken = reason
            log.error("[rank %d] transport broken: %s", self.rank, reason)
            for g in self._groups:
                abort_group(g)
            for fn in self._on_fail:
                try:
                    fn()
                except Exception as e:
                    log.debug("[rank %d] cleanup after a failure failed: %s", self.rank, e)

    def close(self) -> None:
        """Release the groups at close without waiting for the peers to close theirs.

        NCCL's graceful ``shutdown`` (finalize + destroy) is collective within a node: a sender closed
        while its engines keep their receivers open (a rollout worker idle between RPCs) would block
        until they close too, possibly forever. The caller drained its device first, so nothing is in
        flight and ``abort`` frees the communicator without a peer rendezvous; it still runs on a daemon
        thread joined with the channel's deadline, because NCCL's teardown may wait on its proxy threads.
        """
        groups, self._groups, self._on_fail = self._groups, [], []
        if self.broken is not None:
            return  # fail() already aborted every group
        nccl_type = getattr(dist, "ProcessGroupNCCL", None)
        nccl = [g for g in groups if nccl_type is not None and isinstance(g, nccl_type)]
        if not nccl:
            return

        def release() -> None:
            for g in nccl:
                abort_group(g)

        t = threading.Thread(target=release, name=f"ws-close-groups-rank{self.rank}", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            log.warning("[rank %d] NCCL teardown did not finish within %.0f s; left to a daemon thread",
                        self.rank, self.timeout_s)

    def wait(self, work: Any, phase: str, timeout_s: float | None = None, *, gloo: bool = False) -> None:
        """Wait for ``work`` with a deadline; a timeout or comm error breaks the channel and raises.

        gloo: the work is a gloo collective (the control group's), so the host blocks on it in slices and
        wakes when it completes; other works (NCCL) are polled, since their ``wait`` is a stream wait.
        """
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)

        def timed_out() -> BaseException:
            msg = (f"[rank {self.rank}] {phase}: no progress from {self.peers} within "
                   f"{deadline.timeout_s:.1f} s")
            self.fail(msg)
            return TransportTimeout(msg)

        try:
            waited = (wait_gloo(work, deadline, timed_out) if gloo
                      else poll(work.is_completed, deadline, timed_out))
            work.wait()
        except TransportTimeout:
            raise  # our deadline (timed_out already broke the channel)
        except Exception as e:
            # gloo reports its own deadline as an error; keep it a timeout for the caller.
            is_timeout = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
            what = "timed out" if is_timeout else "failed"
            msg = f"[rank {self.rank}] {phase}: communication with {self.peers} {what}: {e}"
            self.fail(msg)
            raise (TransportTimeout if is_timeout else TransportError)(msg) from e
        self.count("comm", waited)

    def wait_event(self, event: Any, phase: str, what: str = "the device") -> None:
        """Wait (with the channel's deadline) until a CUDA event completed; a timeout breaks the channel.

        Never ``event.synchronize()``: that blocks without a deadline, and a stream can be stuck behind
        a dead peer's collective.
        """
        deadline = Deadline(self.timeout_s)

        def timed_out() -> BaseException:
            msg = f"[rank {self.rank}] {phase}: {what} did not finish within {deadline.timeout_s:.1f} s"
            self.fail(msg)
            return TransportTimeout(msg)

        self.count("device", poll(event.query, deadline, timed_out))

    def guard(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Issue a collective; an immediate failure breaks the channel like a failed wait."""
        self.check()
        try:
            return fn()
        except Exception as e:
            msg = f"[rank {self.rank}] {phase}: cannot issue a collective with {self.peers}: {e}"
            self.fail(msg)
            raise TransportError(msg) from e

    # ------------------------------------------------------------------ control messages
    def use_links(self, links: dict[int, Any]) -> None:
        """Carry the control messages over ``links`` from now on (``doorbell.Link`` s by peer rank: rank
        0's to every receiver, a receiver's to rank 0), instead of gloo collectives.

        Colocated backends have a Unix socket per receiver anyway: a message there costs tens of
        microseconds, where a gloo broadcast or all-gather costs ~0.5 ms on a busy host (three thread
        hand-offs per message), twice per update. Both sides switch at the same point of the protocol
        (after the connect exchange); a broken channel closes the links (``on_fail``), so a peer blocked
        on one sees EOF at once.
        """
        self._links = links
        for link in links.values():
            self.on_fail(link.close)

    def _over_links(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Run a control exchange over the links; a dead or silent peer breaks the channel."""
        self.check()
        try:
            return fn()
        except (TransportTimeout, TransportError) as e:
            msg = f"[rank {self.rank}] {e}"
            self.fail(msg)
            raise type(e)(msg) from e

    def broadcast_bytes(self, payload: bytes | None, phase: str, timeout_s: float | None = None) -> bytes:
        """Rank 0 sends ``payload``; every other rank returns it. One broadcast of ``INLINE_BYTES`` (length
        and the first bytes), a second one only for what does not fit (a manifest); over control links,
        one message per receiver."""
        if self._links is not None:
            deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
            self.count("control")
            links = self._links
            if self.rank == 0:
                assert payload is not None
                message = bytes(payload)
                self._over_links(phase, lambda: [link.send_bytes(message, deadline, phase) for link in links.values()])
                return message
            return self._over_links(phase, lambda: links[0].recv_bytes(deadline, phase))  # type: ignore[no-any-return]
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        head = self._inline
        room = INLINE_BYTES - 8
        if self.rank == 0:
            assert payload is not None
            first = payload[:room]
            head[:8].view(torch.int64)[0] = len(payload)
            if first:
                self._inline_np[8 : 8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
        self.count("control")
        w = self.guard(phase, lambda: self.group.broadcast([head], opts))
        self.wait(w, phase, timeout_s, gloo=True)
        n = int(head[:8].view(torch.int64)[0])
        if not 0 <= n < _MAX_MESSAGE_BYTES:
            msg = f"[rank {self.rank}] {phase}: a control message announced {n} bytes"
            self.fail(msg)
            raise TransportError(msg)
        rest = b""
        if n > room:
            body = torch.empty(n - room, dtype=torch.uint8)
            if self.rank == 0:
                assert payload is not None
                body.copy_(torch.frombuffer(bytearray(payload[room:]), dtype=torch.uint8))
            w = self.guard(phase, lambda: self.group.broadcast([body], opts))
            self.wait(w, phase, timeout_s, gloo=True)
            rest = bytes(body.numpy().tobytes())
        if self.rank == 0:
            return payload  # type: ignore[return-value]
        return self._inline_np[8 : 8 + min(n, room)].tobytes() + rest

    def exchange_status(self, status: RankStatus) -> list[RankStatus]:
        """All-gather every rank's status record; every rank returns the same list, ordered by rank (over
        control links: every receiver sends its record to rank 0, which sends all of them back)."""
        phase = f"status exchange after {status.phase}"
        raw = status.to_bytes()
        if self._links is not None:
            self.count("control")
            records = self._over_links(phase, lambda: self._swap_records(raw, phase))
            return [RankStatus.from_bytes(b, r) for r, b in enumerate(records)]
        n = len(raw)
        mine = self._status_np
        mine[:n] = np.frombuffer(raw, dtype=np.uint8)
        if self._status_len > n:
            mine[n : self._status_len] = 0  # a record ends at its first NUL byte
        self._status_len = n
        out = self._status_out
        self.count("control")
        w = self.guard(phase, lambda: self.group.allgather([out], [self._status_mine]))
        self.wait(w, phase, gloo=True)
        # from_bytes copies what it keeps: the slots are reused by the next exchange.
        return [RankStatus.from_bytes(a.tobytes(), r) for r, a in enumerate(self._status_out_np)]

    def _swap_records(self, raw: bytes, phase: str) -> list[bytes]:
        """Every rank's status record, by rank, over the control links (see :meth:`exchange_status`)."""
        assert self._links is not None
        deadline = Deadline(self.timeout_s)
        if self.rank != 0:
            link = self._links[0]
            link.send_bytes(raw, deadline, phase)
            joined = link.recv_bytes(deadline, phase)
            records: list[bytes] = []
            at = 0
            while at < len(joined) and len(records) < self.size:
                (n,) = _RECORD_LEN.unpack_from(joined, at)
                records.append(joined[at + 8 : at + 8 + n])
                at += 8 + n
            if len(records) != self.size or at != len(joined):
                raise TransportError(f"{phase}: the sender's status list does not hold {self.size} records")
            return records
        records = [raw] + [self._links[r].recv_bytes(deadline, phase) for r in range(1, self.size)]
        joined = b"".join(_RECORD_LEN.pack(len(b)) + b for b in records)
        for link in self._links.values():
            link.send_bytes(joined, deadline, phase)
        return records

    def allreduce_max(self, values: torch.Tensor, phase: str) -> Any:
        """Start an all-reduce MAX of a small int64 CPU tensor; returns the work (wait with ``wait``)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        return self.guard(phase, lambda: self.group.allreduce([values], opts))

    def ibroadcast(self, t: torch.Tensor, phase: str) -> Any:
        """Start a broadcast of a small CPU tensor from rank 0; returns the work."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.guard(phase, lambda: self.group.broadcast([t], opts))


def agreed_failure(statuses: list[RankStatus]) -> list[RankStatus]:
    """The failed records of a status exchange (empty when every rank succeeded)."""
    return [s for s in statuses if not s.ok]


def describe_failures(failed: list[RankStatus], phase: str, world_size: int) -> str:
    parts = [f"rank {s.rank}{' (sender)' if s.rank == 0 else ''}: {s.error_type}: {s.message}" for s in failed]
    return f"{phase} failed on {len(failed)} of {world_size} ranks; " + "; ".join(parts)


def warm_up(channel: Channel, data: Any, device: torch.device) -> None:
    """One tiny broadcast from rank 0 on the data group, at connect.

    The first collective creates the communicator (NCCL: seconds); doing it now keeps that cost out of
    the first update, and a peer that cannot join fails the connect, naming the phase.
    """
    warm = torch.zeros(1, dtype=torch.int64, device=device)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    channel.wait(channel.guard("connect", lambda: data.broadcast([warm], opts)), "connect")
