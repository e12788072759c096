"""The receiver's link: joining a sender's transport and turning its calls' bytes into session loads.

:class:`ReceiverLink` is what a :class:`~weight_sync.transport.receiver.WeightReceiver` holds between
``connect`` and ``close``: the control channel, the data plane and its buffers (or the zero-copy
importer), the bucket checks and the bucket layouts. It knows nothing of the protocol's states (which
update is open, which phase the sender is in); the receiver decides *when* a call is consumed, the
link decides *how*: :meth:`ReceiverLink.consume_call` walks one sender call forward - buffers ->
bucket layout -> checks -> the update session's ``load`` - and returns the tensors loaded and the
error to report in the call's status exchange.

:func:`join_link` and :func:`open_plane` are the connect-time wiring per backend: gloo / nccl join a data group and allocate
their buffers; shm / ipc open the sender's buffers (or, zero-copy, its storages) and the doorbell, whose
hello carries the outcome so that a receiver failing here never leaves the sender waiting.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_sync.checksum import prepare_checksum
from weight_sync.errors import TransportError, UpdateStateError
from weight_sync.layers.streams import device_shim
from weight_sync.manifest import Manifest
from weight_sync.transport.buffers import (
    allocate_buffers,
    device_uuid,
    import_ipc_buffer,
    open_shm_buffer,
)
from weight_sync.transport.checks import BucketChecks
from weight_sync.transport.consumer import BucketConsumer
from weight_sync.transport.doorbell import CONTROL, Link, connect_doorbell
from weight_sync.transport.group import Channel, Deadline, make_group, poll, warm_up
from weight_sync.transport.layout import LayoutCache
from weight_sync.transport.planes import BroadcastReceiverPlane, SharedReceiverPlane
from weight_sync.transport.wire import (
    TRAILER_BYTES,
    ControlHeader,
    Hello,
    IpcBufferHandle,
    ShmBufferHandle,
    WireParams,
    b64decode,
)
from weight_sync.transport.zerocopy import RegionImporter, load_in_place

__all__ = ["ReceiverLink", "join_link", "open_plane"]

log = logging.getLogger(__name__)

PREFIX = "weight_sync"


@dataclass(slots=True, kw_only=True)
class ReceiverLink:
    """One receiver's end of a connected transport (see the module docstring)."""

    rank: int
    params: WireParams
    store: Any
    channel: Channel
    device: torch.device  # where the buffers live (the engine's device for nccl / ipc, else the CPU)
    shim: Any
    layouts: LayoutCache
    checks: BucketChecks
    plane: BroadcastReceiverPlane | SharedReceiverPlane | None = None
    buffers: list[torch.Tensor] = field(default_factory=list)
    consumer: BucketConsumer | None = None  # the bucket loop (not with zero-copy)
    doorbell: Link | None = None
    control: Link | None = None  # shm / ipc: the control messages' link (Channel.use_links after connect)
    zc: RegionImporter | None = None  # zero-copy: the sender's storages, imported once
    zc_event: Any = None  # zero-copy ipc: the sender's "tensors produced" event
    events: list[Any] | None = None  # ipc: the sender's packing events, one per buffer

    def consume_call(self, header: ControlHeader, manifest: Manifest | None, session: Any, version: Any,
                     error: BaseException | None, loaded_hook: Callable[[], None] | None = None,
                     ) -> tuple[int, BaseException | None]:
        """Take one sender call's data into ``session``; returns (tensors loaded, error to report).

        A rank that already failed (``error``) or has no open update still takes the call's buckets,
        without loading them, so that the sender and the other receivers are never left waiting. A
        bucket layout that differs from the sender's breaks the channel and raises here (the two sides
        cannot agree on what the bytes are). ``loaded_hook`` (zero-copy): called once every load of the
        call is queued, before waiting for the device to complete them.
        """
        if manifest is None or session is None:
            error = error or UpdateStateError(f"[rank {self.rank}] update_weights arrived without an open update")
        if header.zero_copy is not None:
            return self._consume_zero_copy(header, manifest, session, error, version, loaded_hook)
        # Without a manifest (this rank has no open update) the call is planned as empty.
        layout = self.layouts.get(manifest.tensors if manifest else (), header.first, header.count)
        if layout.num_buckets != header.num_buckets:
            msg = (f"[rank {self.rank}] update_weights: the sender cut tensors {header.first}..."
                   f"{header.first + header.count} into {header.num_buckets} buckets, this receiver into "
                   f"{layout.num_buckets}; sender and receiver run different weight_sync versions")
            self.channel.fail(msg)
            raise TransportError(msg)
        assert self.consumer is not None  # set at connect (every backend but zero-copy and disk)
        return self.consumer.consume_call(header, layout, session, version, error)

    def _consume_zero_copy(self, header: ControlHeader, manifest: Manifest | None, session: Any,
                           error: BaseException | None, version: Any,
                           loaded_hook: Callable[[], None] | None) -> tuple[int, BaseException | None]:
        """A call without buffers: import the new regions, load from the sender's memory in place."""
        zc = header.zero_copy or {}
        table = zc.get("table")
        loaded = 0
        try:
            if self.zc is None:
                raise TransportError(f"[rank {self.rank}] a zero-copy call arrived on a transport without zero_copy")
            self.zc.add(zc.get("regions") or [])
            if table is None:
                self.zc.drop(None, reset=True)  # the sender failed: release this call's exports too
            elif error is None:
                metas = manifest.tensors[header.first : header.first + header.count]  # type: ignore[union-attr]
                loaded = load_in_place(self.zc, (header.first, header.count), zc, metas, session,
                                       self.channel, self.zc_event, self.shim, loaded_hook)
        except Exception as e:
            error = error or e
            log.error("[rank %d] update %r: zero-copy call %d: %s", self.rank, version, header.call, e)
        return loaded, error

    def drained(self) -> bool:
        """Whether the compute stream finishes its queued work within the timeout (always, off CUDA).

        With deferred verification the compute stream may hold loads queued behind receives (or, ipc,
        behind the sender's packing) when a failure is raised; a broken channel has aborted its groups,
        which ends stuck collectives, so this normally returns at once.
        """
        if not self.shim.is_cuda:
            return True
        ev = self.shim.event()
        ev.record(self.shim.current_stream())
        timeout = self.params.timeout_s

        class _Stuck(Exception):
            pass

        try:
            poll(ev.query, Deadline(timeout), _Stuck)
        except _Stuck:
            log.error("[rank %d] the device did not drain within %.1f s", self.rank, timeout)
            self.channel.fail(f"[rank {self.rank}] the device stream is stuck behind a transfer")
            return False
        return True

    def close(self) -> None:
        """Release buffers, imports and groups; the caller has drained the device first."""
        self.plane = None
        for end in (self.doorbell, self.control):
            if end is not None:
                end.close()
        self.doorbell = self.control = None
        self.consumer = None  # its views of the buffers and its staging go with them
        self.buffers = []  # drops the single import of each IPC buffer (its reference is released)
        if self.zc is not None:
            self.zc.close()  # zero-copy: releases every import of the sender's storages
        self.channel.close()
        self.store = None


def _buffer_device(params: WireParams, device: torch.device, rank: int) -> torch.device:
    if params.backend in ("nccl", "ipc"):
        if device.type != "cuda":
            raise TransportError(
                f"[rank {rank}] backend {params.backend!r} needs the engine on a CUDA device, got {device}"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def join_link(store: Any, params: WireParams, rank: int, device: torch.device) -> ReceiverLink:
    """Announce this receiver (its hello) and join the sender's control group (every backend but disk)."""
    device = _buffer_device(params, device, rank)
    shim = device_shim(device)
    prepare_checksum(device)
    hello = Hello(rank=rank, host=socket.gethostname(), pid=os.getpid(), device=str(device),
                  device_uuid=device_uuid(device) if device.type == "cuda" else None)
    store.set(f"{PREFIX}/hello/{rank}", hello.to_json())
    ctl = make_group("gloo", store, f"{PREFIX}/ctl", rank, params.world_size, params.timeout_s)
    channel = Channel(ctl, rank, params.world_size, params.timeout_s, "the sender (rank 0)")
    return ReceiverLink(rank=rank, params=params, store=store, channel=channel, device=device, shim=shim,
                        layouts=LayoutCache(params.bucket_bytes, params.align_bytes),
                        checks=BucketChecks(rank, params.checksum, channel, shim))


def open_plane(link: ReceiverLink, *, rollback: bool) -> BaseException | None:
    """Set up the data plane of a joined link; returns a failure to report in the connect exchange.

    The caller reports the outcome in the connect status exchange, so one failing receiver makes every
    rank raise the same error instead of leaving the others waiting.
    """
    params, store, rank, device, shim = link.params, link.store, link.rank, link.device, link.shim
    channel = link.channel
    nbytes = params.bucket_bytes + TRAILER_BYTES
    error: BaseException | None = None
    if params.backend in ("nccl", "gloo"):
        data = make_group(params.backend, store, f"{PREFIX}/data", rank, params.world_size, params.timeout_s)
        channel.add_group(data)
        link.buffers = allocate_buffers(params.num_buffers, nbytes, device)
        link.plane = BroadcastReceiverPlane(channel, data, link.buffers, shim)
        warm_up(channel, data, device)
    else:
        error = _open_shared(link, nbytes)
        try:
            # Always open the doorbell, even after a failure above: the hello carries the outcome, so
            # the sender is not left waiting for this receiver's link until its timeout.
            info = json.loads(store.get(f"{PREFIX}/doorbell"))
            outcome = {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}"}
            link.doorbell = connect_doorbell(info, rank, outcome, params.timeout_s)
            channel.on_fail(link.doorbell.close)
            link.control = connect_doorbell(info, rank, {"role": CONTROL}, params.timeout_s)
            channel.on_fail(link.control.close)
        except Exception as e:
            error = error or e
        link.plane = SharedReceiverPlane(channel, link.doorbell, link.buffers, shim, link.events)
    if link.plane is not None and link.zc is None:
        link.consumer = BucketConsumer(rank, link.plane, link.buffers, link.checks, device,
                                       params.verify == "deferred", rollback)
    return error


def _open_shared(link: ReceiverLink, nbytes: int) -> BaseException | None:
    """shm / ipc: open the sender's buffers (or zero-copy importer); returns the failure, if any."""
    params, store, rank = link.params, link.store, link.rank
    try:
        if params.zero_copy:
            link.zc = RegionImporter(params.backend, rank, link.device)
            if params.backend == "ipc":
                handle = json.loads(store.get(f"{PREFIX}/events"))[0]
                link.zc_event = torch.cuda.Event.from_ipc_handle(link.device, b64decode(handle))
        elif params.backend == "shm":
            raw = json.loads(store.get(f"{PREFIX}/buffers"))
            link.buffers = [open_shm_buffer(ShmBufferHandle.from_dict(d)) for d in raw]
        else:
            raw = json.loads(store.get(f"{PREFIX}/buffers/{rank}"))
            link.buffers = [import_ipc_buffer(IpcBufferHandle.from_dict(d)) for d in raw]
            # The sender's packing events (one per buffer): our compute stream waits on them.
            handles = json.loads(store.get(f"{PREFIX}/events"))
            link.events = [torch.cuda.Event.from_ipc_handle(link.buffers[0].device, b64decode(h))
                            for h in handles]
        if link.buffers:
            prepare_checksum(link.buffers[0].device)  # an IPC import may be another device index
        expected = 0 if params.zero_copy else params.num_buffers
        if len(link.buffers) != expected or any(b.numel() != nbytes for b in link.buffers):
            raise TransportError(
                f"[rank {rank}] connect: expected {expected} shared buffers of {nbytes} "
                f"bytes, got {[b.numel() for b in link.buffers]}"
            )
    except Exception as e:
        return e
    return None
