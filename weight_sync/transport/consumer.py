"""Bucket consumption on a receiver: wait for each bucket of a call, check it, hand its tensors to the session.

The receiver (``receiver.py``) keeps the protocol state (headers, phases, status exchanges); this module is
what one sender call's data goes through on its way to the update session: the plane's wait for bucket
``k`` in buffer ``k % n``, its trailer and checksum (recorded behind the wait, judged per bucket or once
per call), the views of its complete tensors, the staging of tensors split across buckets, the release.

The views of a bucket's tensors depend only on the bucket layout and the buffer it lands in, and both
live as long as the transport (layouts are cached per call split, buffers allocated once), so they are
built once and reused by every update with that layout: per tensor the host then only hands a view to
the session. The session copies out of them before ``load`` returns (nothing refers to a buffer after
its release), so holding the views is holding only the buffers, which the receiver holds anyway.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from weight_sync.transport.checks import BucketChecks
from weight_sync.transport.layout import Bucket, BucketLayout
from weight_sync.transport.planes import BroadcastReceiverPlane, SharedReceiverPlane
from weight_sync.transport.wire import STATUS_ABORT, TRAILER_BYTES, ControlHeader

__all__ = ["BucketConsumer"]

log = logging.getLogger(__name__)

# (name, view of the buffer) of a bucket's whole tensors, then the segments of split tensors, in order.
_Views = tuple[list[tuple[str, torch.Tensor]], bool]


class BucketConsumer:
    """One receiver's bucket loop: plane waits and releases, checks, views, split-tensor staging."""

    def __init__(self, rank: int, plane: BroadcastReceiverPlane | SharedReceiverPlane, buffers: list[torch.Tensor],
                 checks: BucketChecks, buffer_device: torch.device, deferred: bool, rollback: bool) -> None:
        self.rank = rank
        self.plane = plane
        self.buffers = buffers
        self.checks = checks
        self.deferred = deferred
        # Whether the host waits (with the deadline) for each bucket to arrive before queueing its work.
        # Deferred: no, the compute stream waits on the device. Except with rollback on CUDA: the session
        # snapshots a layer with a blocking device->host copy before its first write, and that copy must
        # never sit behind a receive (or a peer's packing) that may never complete.
        self.host_wait = not deferred or (buffer_device.type == "cuda" and rollback)
        self.device = buffers[0].device if buffers else buffer_device
        self.staging: torch.Tensor | None = None
        # Views of each (bucket, buffer) of the layout last consumed; rebuilt when the layout changes.
        self._layout: BucketLayout | None = None
        self._views: dict[tuple[int, int], _Views] = {}

    def consume_call(self, header: ControlHeader, layout: BucketLayout, session: Any, version: Any,
                     error: BaseException | None) -> tuple[int, BaseException | None]:
        """Receive every bucket of the call; load them unless ``error`` (this rank already failed).

        Returns (tensors loaded, this rank's error for the call's status exchange). A failing rank keeps
        receiving and releasing buckets, so the sender and the other receivers are never left waiting.
        """
        plane, judge, buffers = self.plane, self.checks, self.buffers
        sizes = [b.payload_bytes + TRAILER_BYTES for b in layout.buckets]
        checks = judge.table(layout.num_buckets, self.device)
        if layout is not self._layout:
            self._layout, self._views = layout, {}
        plane.begin_call(sizes, header.seq, header.call)
        nb = len(buffers)
        aborted = False
        loaded = 0
        recorded = 0  # buckets whose checks are in the table (deferred)
        for k, bucket in enumerate(layout.buckets):
            i = k % nb
            # deferred: the compute stream waits for bucket k on the device and the host goes on; the
            # receive of bucket k+1 (k+n-1) is already posted, so it lands while bucket k is loaded.
            plane_status = plane.wait(k, i, host=self.host_wait)
            if error is None and not aborted:
                try:
                    if plane_status == STATUS_ABORT:
                        aborted = True  # the sender gave up (told out of band); its status says why
                    elif self.deferred:
                        # Trailer and checksum land in row k on the device, before release() lets the
                        # buffer be overwritten; they are judged once, after the last bucket.
                        judge.record(bucket, buffers[i], checks[k])
                        recorded = k + 1
                        loaded += self._load(k, i, bucket, layout, session)
                    else:
                        judge.record(bucket, buffers[i], checks[0])
                        vals = judge.readback(checks[:1], f"update_weights: checks of bucket {k}")[0]
                        if judge.judge(vals, bucket, k, header, layout.metas, version, loaded=False):
                            loaded += self._load(k, i, bucket, layout, session)
                        else:
                            aborted = True
                except Exception as e:
                    error = e
                    log.error("[rank %d] update %r: bucket %d: %s", self.rank, version, k, e)
            plane.release(k, i, failed=error is not None)
        plane.end_call()
        if recorded:
            # The one device->host read of the call. The first bad bucket in order decides, as if it had
            # been checked before its load: a trailer or checksum failure, or the sender's ABORT, at or
            # before the bucket where loading failed replaces that load error (it is the root cause, and
            # checked first, that load would not have happened).
            rows = judge.readback(checks[:recorded], "update_weights: checks of the call's buckets")
            try:
                for k, vals in enumerate(rows):
                    if not judge.judge(vals, layout.buckets[k], k, header, layout.metas, version, loaded=True):
                        error = None
                        break
            except Exception as e:
                error = e
                log.error("[rank %d] update %r: %s", self.rank, version, e)
        return loaded, error

    def _bucket_views(self, k: int, i: int, bucket: Bucket, layout: BucketLayout) -> _Views:
        views = self._views.get((k, i))
        if views is None:
            buf = self.buffers[i]
            whole = []
            for seg in bucket.segments:
                meta = layout.metas[seg.index]
                if seg.nbytes == meta.nbytes:
                    raw = buf[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
                    # A flat uint8 tensor (every delta payload) is the slice itself: each torch view
                    # costs about a microsecond of host time, and a call holds hundreds of tensors.
                    if meta.dtype != torch.uint8 or len(meta.shape) != 1:
                        raw = raw.view(meta.dtype).view(meta.shape)
                    whole.append((meta.name, raw))
            views = (whole, len(whole) == len(bucket.segments))
            self._views[(k, i)] = views
        return views

    def _load(self, k: int, i: int, bucket: Bucket, layout: BucketLayout, session: Any) -> int:
        """Hand the bucket's complete tensors to the session (which copies them out before returning)."""
        whole, only_whole = self._bucket_views(k, i, bucket, layout)
        if only_whole:
            session.load(whole)
            return len(whole)
        buf = self.buffers[i]
        batch: list[tuple[str, torch.Tensor]] = []
        count = 0
        views = iter(whole)
        for seg in bucket.segments:
            meta = layout.metas[seg.index]
            if seg.nbytes == meta.nbytes:
                batch.append(next(views))
                continue
            # A tensor split across buckets is reassembled in one staging tensor (allocated once at
            # the largest split size, then reused).
            if self.staging is None or self.staging.numel() < meta.nbytes:
                self.staging = torch.empty(layout.max_split_bytes, dtype=torch.uint8, device=buf.device)
            self.staging[seg.tensor_offset : seg.tensor_offset + seg.nbytes].copy_(
                buf[seg.bucket_offset : seg.bucket_offset + seg.nbytes]
            )
            if seg.tensor_offset + seg.nbytes == meta.nbytes:
                # Load now: a later segment of this bucket may start the next split tensor in staging.
                batch.append((meta.name, self.staging[: meta.nbytes].view(meta.dtype).view(meta.shape)))
                session.load(batch)
                count += len(batch)
                batch = []
        if batch:
            session.load(batch)
        return count + len(batch)
