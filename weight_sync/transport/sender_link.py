"""The sender's connect-time wiring: what one update reports, and sharing shm / ipc with the receivers.

:class:`TransferReport` is what every update of a :class:`~weight_sync.transport.sender.WeightSender`
returns. :func:`share_with_receivers` is the shm / ipc half of ``connect`` (the counterpart of
:func:`~weight_sync.transport.receiver_link.open_plane`): it publishes the buffers (or, zero-copy, prepares
the storage exporter), the packing events and the doorbell address in the store, then accepts each
receiver's two sockets (doorbell and control link). Whatever it made stays in a :class:`SharedSide`
even when a later step fails, so the caller can unlink and close it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from weight_sync.transport.buffers import allocate_buffers, create_shm_buffers, export_ipc_buffer
from weight_sync.transport.config import TransportConfig
from weight_sync.transport.doorbell import CONTROL, DOORBELL, DoorbellServer, Link
from weight_sync.transport.wire import b64encode
from weight_sync.transport.zerocopy import RegionExporter
from weight_sync.transport.zerocopy_sender import ZeroCopyCalls

__all__ = ["SharedSide", "TransferReport", "share_with_receivers"]

PREFIX = "weight_sync"


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferReport:
    """What one update moved: bytes, buckets, time, and every receiver's update report (by rank)."""

    version: Any
    backend: str
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    # The update_weights calls until their last bucket was handed over: the last broadcast completed
    # (nccl/gloo), every receiver released every bucket (buffered shm/ipc), or every receiver loaded and
    # reported (zero-copy). The call's status exchange is outside it except for zero-copy.
    transfer_seconds: float
    # The update_weights calls as their caller saw them, entry to return: transfer_seconds plus, for
    # nccl/gloo/buffered links, the receivers' check and load of the last bucket and the status exchange.
    call_seconds: float = 0.0
    receivers: list[dict[str, Any]] = field(default_factory=list)
    host_waits: dict[str, int] = field(default_factory=dict)
    """The sender's host waits during the update, by kind (see ``Channel.stats``); each receiver's are in
    ``receivers[i]['transport']``."""
    delta: dict[str, Any] = field(default_factory=dict)
    """Delta sync: 'mode' ('delta' or 'full' and why), changed elements, wire and plain bytes."""

    @property
    def gbps(self) -> float:
        """Payload GB/s over the update_weights calls (1 GB = 1e9 bytes)."""
        return self.num_bytes / self.transfer_seconds / 1e9 if self.transfer_seconds > 0 else 0.0

    @property
    def fingerprints(self) -> list[str | None]:
        return [r.get("fingerprint") for r in self.receivers]


@dataclass
class SharedSide:
    """The sender's shm / ipc state made at connect: buffers (or the zero-copy calls), their packing
    events (ipc), and each receiver's doorbell and control links by rank."""

    buffers: list[torch.Tensor] = field(default_factory=list)
    shm_handles: list[Any] = field(default_factory=list)
    events: list[Any] | None = None
    zc: ZeroCopyCalls | None = None
    links: dict[int, Link] = field(default_factory=dict)
    control: dict[int, Link] = field(default_factory=dict)
    hellos: dict[int, dict[str, Any]] = field(default_factory=dict)


def share_with_receivers(cfg: TransportConfig, store: Any, device: torch.device, num_receivers: int,
                         nbytes: int, side: SharedSide) -> None:
    """Share buffers of ``nbytes`` (or the zero-copy exporter) with ``num_receivers`` receivers and accept
    their links into ``side``; raises on any failure, leaving what was made in ``side``."""
    ranks = list(range(1, num_receivers + 1))
    # Two links per receiver (doorbell, control); a connect finding the backlog full fails at once.
    server = DoorbellServer(cfg.shm_dir, backlog=2 * num_receivers)
    try:
        store.set(f"{PREFIX}/doorbell", json.dumps(server.info()))
        if cfg.zero_copy:
            # No buffers: receivers map the source's own storages, call by call (``zerocopy``).
            event = torch.cuda.Event(interprocess=True) if cfg.backend == "ipc" else None
            side.zc = ZeroCopyCalls(RegionExporter(cfg.backend, device, ranks), event, device)
            store.set(f"{PREFIX}/buffers", "[]")
            if event is not None:
                store.set(f"{PREFIX}/events", json.dumps([b64encode(bytes(event.ipc_handle()))]))
        elif cfg.backend == "shm":
            side.buffers, side.shm_handles = create_shm_buffers(cfg.shm_dir, cfg.num_buffers, nbytes)
            store.set(f"{PREFIX}/buffers", json.dumps([h.to_dict() for h in side.shm_handles]))
        else:  # ipc: one export of each buffer per receiver, each imported exactly once
            side.buffers = allocate_buffers(cfg.num_buffers, nbytes, device)
            for r in ranks:
                store.set(f"{PREFIX}/buffers/{r}", json.dumps([export_ipc_buffer(b).to_dict() for b in side.buffers]))
            # Recorded after each packing; receivers' compute streams wait on them (no host sync here).
            side.events = [torch.cuda.Event(interprocess=True) for _ in side.buffers]
            store.set(f"{PREFIX}/events", json.dumps([b64encode(bytes(e.ipc_handle())) for e in side.events]))
        by_role, side.hellos = server.accept_roles(ranks, (DOORBELL, CONTROL), cfg.timeout_s)
        side.links, side.control = by_role[DOORBELL], by_role[CONTROL]
    finally:
        server.close()  # unlinks the socket file: every receiver is connected (or never will be)
