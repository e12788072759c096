"""Receiver-side bucket checks: each bucket's trailer and recomputed checksum, recorded on the device behind
its arrival, read to the host once per call ('deferred') or once per bucket ('before_load'), then judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from weight_sync.checksum import ChecksumWorkspace, bucket_checksum, checksum_value, reuse_workspace
from weight_sync.errors import ChecksumError, TransportError
from weight_sync.layers.streams import DeviceShim
from weight_sync.manifest import TensorMeta
from weight_sync.transport.group import Channel
from weight_sync.transport.layout import Bucket
from weight_sync.transport.wire import (
    MAGIC,
    STATUS_ABORT,
    TRAILER_BYTES,
    TRAILER_FIELDS,
    ControlHeader,
)

__all__ = ["CHECK_WORDS", "BucketChecks"]

# One row per bucket of a call: the 8 trailer words as received, then the 2 checksum words recomputed here.
CHECK_WORDS = len(TRAILER_FIELDS) + 2


class BucketChecks:
    """One receiver's check table (grown to the most buckets a call has had, then reused: nothing is
    allocated per update in steady state), its pinned host mirror and the checksum intermediates."""

    def __init__(self, rank: int, checksum: bool, channel: Channel, shim: DeviceShim) -> None:
        self.rank = rank
        self.checksum = checksum
        self.channel = channel
        self.shim = shim
        self._rows: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._ck: ChecksumWorkspace | None = None  # allocated on first use

    def table(self, num_buckets: int, device: torch.device) -> torch.Tensor:
        """The int64 [buckets, CHECK_WORDS] table on ``device`` (the buffers' device)."""
        need = max(1, num_buckets)
        if self._rows is None or self._rows.shape[0] < need:
            self._rows = torch.zeros((need, CHECK_WORDS), dtype=torch.int64, device=device)
            if device.type == "cuda":
                self._host = torch.zeros((need, CHECK_WORDS), dtype=torch.int64, pin_memory=True)
        return self._rows

    def record(self, bucket: Bucket, buf: torch.Tensor, row: torch.Tensor) -> None:
        """Copy the bucket's trailer and (if enabled) its recomputed checksum into ``row``, on the compute
        stream (behind the wait for the bucket): no host read."""
        p = bucket.payload_bytes
        row[: len(TRAILER_FIELDS)].copy_(buf[p : p + TRAILER_BYTES].view(torch.int64))
        if self.checksum:
            self._ck = reuse_workspace(self._ck, buf.device)
            bucket_checksum(buf[:p], out=row[len(TRAILER_FIELDS) :], workspace=self._ck)

    def readback(self, rows: torch.Tensor, phase: str) -> list[list[int]]:
        """Read ``rows`` to the host. CUDA: a copy into pinned memory behind the loads, then an event polled
        with the deadline (a plain ``.tolist()`` would block without one, and the stream may be stuck
        behind a dead peer)."""
        self.channel.count("readback")
        if rows.device.type != "cuda":
            return rows.tolist()
        assert self._host is not None
        host = self._host[: rows.shape[0]]
        host.copy_(rows, non_blocking=True)
        if self._event is None:
            self._event = self.shim.event()
        self._event.record(self.shim.current_stream())
        self.channel.wait_event(self._event, phase)
        return host.tolist()

    def judge(self, vals: Sequence[int], bucket: Bucket, k: int, header: ControlHeader,
              metas: Sequence[TensorMeta], version: Any, *, loaded: bool) -> bool:
        """Check one bucket's trailer and checksum words; False: the sender aborted from this bucket on.
        ``metas``: the call's tensors (the bucket's names, for an error message only)."""
        p = bucket.payload_bytes
        magic, seq, call, kk, status, pbytes, hi, lo, got_hi, got_lo = vals
        if (magic, seq, call, kk) != (MAGIC, header.seq, header.call, k) or (status != STATUS_ABORT and pbytes != p):
            raise TransportError(
                f"[rank {self.rank}] update_weights: bucket {k} carries trailer (magic={magic:#x}, update "
                f"{seq}, call {call}, bucket {kk}, {pbytes} bytes), expected (magic={MAGIC:#x}, update "
                f"{header.seq}, call {header.call}, bucket {k}, {p} bytes)"
                + ("; its bytes were loaded, the update will not be committed" if loaded else "")
            )
        if status == STATUS_ABORT:
            return False
        if self.checksum and (hi, lo) != (got_hi, got_lo):
            what = ("its bytes were loaded (deferred verification), the update will not be committed" if loaded
                    else "nothing of it was loaded")
            names = [metas[s.index].name for s in bucket.segments]
            raise ChecksumError(
                f"[rank {self.rank}] update {version!r}: bucket {k} ({p} bytes, {names[0]} .. "
                f"{names[-1]}) failed its checksum: sender {checksum_value((hi, lo), p):#018x}, received "
                f"{checksum_value((got_hi, got_lo), p):#018x}; {what}"
            )
        return True
