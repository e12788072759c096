"""The sender's bucket loop: pack a call's tensors into the buffers in block order, write each bucket's
trailer and checksum on the pack stream, and hand each bucket to the data plane."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weight_sync.checksum import ChecksumWorkspace, bucket_checksum, raw_bytes, reuse_workspace
from weight_sync.errors import WeightSyncError
from weight_sync.layers.accessors import PLAIN_TYPES
from weight_sync.layers.streams import DeviceShim
from weight_sync.manifest import TensorMeta
from weight_sync.transport.group import Channel
from weight_sync.transport.layout import Bucket, BucketLayout
from weight_sync.transport.planes import BroadcastSenderPlane, SharedSenderPlane
from weight_sync.transport.source import Checked
from weight_sync.transport.wire import MAGIC, STATUS_ABORT, STATUS_OK, TRAILER_BYTES

__all__ = ["BucketPacker"]

log = logging.getLogger(__name__)


class BucketPacker:
    """Packs calls into the connection's buffers (made once) through its plane; one per sender."""

    def __init__(self, plane: BroadcastSenderPlane | SharedSenderPlane, buffers: list[torch.Tensor],
                 channel: Channel, shim: DeviceShim, device: torch.device, checksum: bool) -> None:
        self.plane = plane
        self.buffers = buffers
        self.channel = channel
        self.shim = shim
        self.device = device
        self.checksum = checksum
        self._ck: ChecksumWorkspace | None = None  # checksum intermediates, allocated on first use
        # Per (bucket, buffer) of the layout last sent: each segment's destination as the tensor's own
        # dtype and shape where the whole tensor lies in that bucket (None: packed as bytes). Made once
        # per layout, so an update with the manifest of the last makes no views.
        self._views_layout: BucketLayout | None = None
        self._views: dict[tuple[int, int], tuple[torch.Tensor | None, ...]] = {}

    def send_call(
        self, layout: BucketLayout, it: Iterator[tuple[str, Any]], first: int, announce: Callable[[], None],
        seq: int, call: int, version: Any,
    ) -> BaseException | None:
        """Pack and submit every bucket of the call; ``announce`` sends the call's header.

        The header goes out once the first bucket's packing is queued, not before: receivers post their
        receives when it arrives, and the device packs bucket 0 while the header travels and they plan,
        so the first broadcast starts without waiting for either.
        """
        plane = self.plane
        nb = len(self.buffers)
        sizes = [b.payload_bytes + TRAILER_BYTES for b in layout.buckets]
        plane.begin_call(sizes, seq, call)
        if layout is not self._views_layout:
            self._views_layout, self._views = layout, {}
        heads = self._trailer_heads(layout, seq, call)
        source = Checked(it, layout.metas, first)
        error: BaseException | None = None
        peer_failed = False
        current: dict[int, torch.Tensor] = {}
        if not layout.buckets:
            announce()
        for k, bucket in enumerate(layout.buckets):
            i = k % nb
            # Buffer reuse: CUDA orders it on the device (the host only keeps a bounded lead); CPU and the
            # shared planes wait on the host for the previous occupant's broadcast / RELEASE.
            peer_failed |= plane.acquire(k, i)
            status = STATUS_OK
            if error is None and not peer_failed:
                try:
                    self._pack(bucket, self.buffers[i], source, current)
                except (Exception, KeyboardInterrupt) as e:
                    error = e
                    log.error("[rank 0] update %r: bucket %d could not be packed: %s", version, k, e)
            if error is not None or peer_failed:
                status = STATUS_ABORT
                current.clear()
            self._write_trailer(bucket, self.buffers[i], k, status, heads)
            if k == 0:
                announce()
            plane.submit(k, i, sizes[k], status)
        peer_failed |= bool(plane.end_call())
        if self.shim.is_cuda and self.channel.broken is None:
            # The caller may overwrite its tensors (an optimizer step) on its stream as soon as this call
            # returns: that stream waits for the packing that still reads them (no host wait).
            self.shim.current_stream().wait_stream(plane.pack_stream)
        if error is None and not peer_failed:
            try:
                source.expect_end()
            except WeightSyncError as e:
                return e
        return error

    def _trailer_heads(self, layout: BucketLayout, seq: int, call: int) -> torch.Tensor:
        """The first six trailer words of every bucket of the call, on the buffers' device.

        One host->device copy per call from pinned memory, on the pack stream: writing each trailer from
        a pageable host tensor would be a blocking copy, i.e. a synchronization of the pack stream per
        bucket.
        """
        rows = torch.tensor(
            [[MAGIC, seq, call, k, STATUS_OK, b.payload_bytes] for k, b in enumerate(layout.buckets)],
            dtype=torch.int64,
        ).reshape(-1, 6)
        if not self.shim.is_cuda:
            return rows
        plane = self.plane
        with plane.pack_stream.use():
            # Allocated on the pack stream, used only there; the caching host allocator keeps the pinned
            # block until this copy has completed.
            return rows.pin_memory().to(self.device, non_blocking=True)

    def _pack(self, bucket: Bucket, buf: torch.Tensor, source: Checked, current: dict[int, torch.Tensor]) -> None:
        """Copy the bucket's segments into ``buf`` on the pack stream and write its checksum.

        A tensor that lies whole in the bucket is copied into a view of its bytes as its own dtype and
        shape, all of the bucket's such tensors in one grouped copy (one call instead of the half dozen
        per tensor of a byte view: ``detach``, ``contiguous``, ``reshape``, ``view``, the slices, the
        copy). Plain tensors only; others, and tensors split over buckets, are copied as bytes. Both
        give the same bytes (a copy into the same dtype is bitwise).
        """
        plane = self.plane
        stream = plane.pack_stream
        cuda = self.shim.is_cuda
        views = self._bucket_views(bucket, buf, source.metas)
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        # The caller's stream, read before any copy is queued on the pack stream.
        caller = self.shim.current_stream() if cuda else None
        for seg, view in zip(bucket.segments, views):
            if view is not None:
                t = source.next_tensor(seg.index)
                if type(t) in PLAIN_TYPES:
                    if cuda and t.is_cuda:
                        # The allocator must not hand its memory out before the pack stream has read it.
                        t.record_stream(stream.raw)  # type: ignore[arg-type]
                    dsts.append(view)
                    srcs.append(t)
                    continue
                flat = raw_bytes(t)
            else:
                held = current.get(seg.index)
                flat = source.next_flat(seg.index) if held is None else held
            if cuda and flat.is_cuda and seg.index not in current:
                # Produced on the caller's stream: the pack stream must see it (see record_stream above).
                stream.wait_stream(caller)  # type: ignore[arg-type]
                flat.record_stream(stream.raw)  # type: ignore[arg-type]
            current[seg.index] = flat
            if seg.nbytes:
                with stream.use():
                    buf[seg.bucket_offset : seg.bucket_offset + seg.nbytes].copy_(
                        flat[seg.tensor_offset : seg.tensor_offset + seg.nbytes], non_blocking=True
                    )
            if seg.tensor_offset + seg.nbytes == flat.numel():
                del current[seg.index]
        if not dsts:
            return
        # no_grad: a source that requires grad (a parameter) must not make the buffer part of a graph.
        if cuda:
            # One wait for every tensor of the bucket: each was produced on the caller's stream before
            # this point.
            stream.wait_stream(caller)  # type: ignore[arg-type]
        with torch.no_grad(), stream.use():
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def _bucket_views(self, bucket: Bucket, buf: torch.Tensor, metas: tuple[TensorMeta, ...]
                      ) -> tuple[torch.Tensor | None, ...]:
        """Each segment's typed destination in ``buf`` (None: copied as bytes), made once per layout."""
        key = (bucket.index, buf.data_ptr())
        views = self._views.get(key)
        if views is None:
            out: list[torch.Tensor | None] = []
            for seg in bucket.segments:
                meta = metas[seg.index]
                size = meta.dtype.itemsize
                whole = seg.tensor_offset == 0 and seg.nbytes == meta.nbytes > 0
                if whole and seg.bucket_offset % size == 0:
                    out.append(buf[seg.bucket_offset : seg.bucket_offset + seg.nbytes].view(meta.dtype)
                               .view(meta.shape))
                else:
                    out.append(None)
            views = self._views[key] = tuple(out)
        return views

    def _write_trailer(self, bucket: Bucket, buf: torch.Tensor, k: int, status: int, heads: torch.Tensor) -> None:
        """Trailer words and checksum of bucket ``k``, written on the pack stream (no host round trip)."""
        plane = self.plane
        p = bucket.payload_bytes
        trailer = buf[p : p + TRAILER_BYTES].view(torch.int64)
        with plane.pack_stream.use():
            trailer[:6].copy_(heads[k], non_blocking=True)
            if status != STATUS_OK:
                trailer[4:5].fill_(status)
            if self.checksum and status == STATUS_OK:
                # Intermediates allocated once (first bucket), not per bucket: no transient memory.
                self._ck = reuse_workspace(self._ck, buf.device)
                bucket_checksum(buf[:p], out=trailer[6:8], workspace=self._ck)
            else:
                trailer[6:8].zero_()
