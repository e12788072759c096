"""WeightSender: the trainer side of a transport (rank 0 of its groups).

Lifecycle: ``WeightSender(config, num_receivers=N)`` starts the rendezvous store (``address``) ->
``connect()`` waits for the N receivers, builds the groups and allocates the buffers once ->
per update ``start_weight_update(manifest, version)`` -> ``update_weights(tensors)`` (one or more calls,
each a consecutive run of the manifest) -> ``finish_weight_update()`` -> ``close()``.

Every phase ends with a status exchange, so a failure on any rank (a bad manifest, a tensor that
disagrees with it, a checksum mismatch, a receiver whose load failed) makes every rank raise the same
error; a sender whose source fails mid-call keeps the receivers' bucket sequence going with ABORT
buckets (no packing) so nobody is left waiting. Communication failures (a dead peer, a timeout) break
the transport: every rank raises at once and a new connection is needed; the sender's call raises
``TransportTimeout`` naming the receivers whose heartbeat stopped (``liveness``), if any did.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch

from weight_sync.checksum import prepare_checksum
from weight_sync.errors import ManifestError, TransportError
from weight_sync.layers.streams import device_shim
from weight_sync.manifest import Manifest, TensorMeta, dtype_to_str
from weight_sync.transport.buffers import allocate_buffers, unlink_shm_buffers
from weight_sync.transport.config import ALIGN_BYTES, TransportConfig
from weight_sync.transport.delta_sync import DeltaSender, wire_manifest
from weight_sync.transport.disk import DiskWriter
from weight_sync.transport.doorbell import Link
from weight_sync.transport.group import Channel, host_store, make_group, warm_up
from weight_sync.transport.layout import LayoutCache, check_block_order
from weight_sync.transport.liveness import naming_unresponsive
from weight_sync.transport.packer import BucketPacker
from weight_sync.transport.planes import BroadcastSenderPlane, SharedSenderPlane
from weight_sync.transport.sender_link import SharedSide, TransferReport, share_with_receivers
from weight_sync.transport.source import Checked, close_source
from weight_sync.transport.status import FOLDED, all_folded, raise_agreed, status_of
from weight_sync.transport.wire import (
    TRAILER_BYTES,
    ControlHeader,
    Hello,
    RankStatus,
    WireParams,
)
from weight_sync.transport.zerocopy_sender import ZeroCopyCalls

__all__ = ["TransferReport", "WeightSender"]

log = logging.getLogger(__name__)

PREFIX = "weight_sync"


class WeightSender:
    """Trainer side of a transport; see the module docstring for the lifecycle."""

    def __init__(self, config: TransportConfig | None = None, *, num_receivers: int = 1, **overrides: Any) -> None:
        config = replace(config, **overrides) if config is not None else TransportConfig(**overrides)
        if not isinstance(num_receivers, int) or num_receivers < 1:
            raise ValueError(f"num_receivers must be an int >= 1, got {num_receivers!r}")
        self.config = config
        self.num_receivers = num_receivers
        self.world_size = num_receivers + 1
        self.params = WireParams(
            backend=config.backend, bucket_bytes=config.bucket_bytes, num_buffers=config.num_buffers,
            checksum=config.checksum, timeout_s=float(config.timeout_s), align_bytes=ALIGN_BYTES,
            world_size=self.world_size, verify=config.verify, zero_copy=config.zero_copy,
        )
        self.peers: list[Hello] = []
        self._state = "new"
        self._seq = 0
        self._manifest: Manifest | None = None
        self._version: Any = None
        self._pos = 0
        self._call = 0
        self._t_start = 0.0
        self._transfer_s = 0.0
        self._call_s = 0.0
        self._num_buckets = 0
        self._layouts = LayoutCache(config.bucket_bytes, ALIGN_BYTES)
        # (tensors as given, manifest as sent, update seq) of the last manifest every receiver accepted.
        self._agreed_manifest: tuple[Any, Manifest, int] | None = None
        self._channel: Channel | None = None
        self._plane: BroadcastSenderPlane | SharedSenderPlane | None = None
        self._buffers: list[torch.Tensor] = []
        self._packer: BucketPacker | None = None  # the bucket loop (not with zero-copy)
        self._shm_handles: list[Any] = []
        self._links: dict[int, Link] = {}
        self._control: dict[int, Link] = {}  # shm / ipc: each receiver's control link (Channel.use_links)
        self._zc: ZeroCopyCalls | None = None  # zero-copy: the exported storages, the call produced early
        self._fused_call = False  # the open update's start header carried its (only) call
        # send() to one receiver over a buffered backend: the open update's start, not yet sent (the
        # update whose manifest it reuses), to go out as its call's header.
        self._deferred_start: int | None = None
        self._stats_at_start: dict[str, int] = {}
        # send(): its call announces the finish (ControlHeader.then_finish); the call's exchange records
        # when every receiver committed in it.
        self._then_finish = False
        self._folded: list[RankStatus] | None = None
        self._disk: DiskWriter | None = None
        # Delta sync: the base (last version every receiver committed) and the delta send.
        self._delta = DeltaSender(base=config.delta_base, chunk_elems=config.delta_chunk_elems) if config.delta else None
        self._store = None
        self.device = torch.device("cpu")
        self.shim = device_shim("cpu")
        if config.backend == "disk":
            self._disk = DiskWriter(config)
        else:
            self._store = host_store(config.host, config.port, config.timeout_s)
            self._store.set(f"{PREFIX}/wire", self.params.to_json())

    # ------------------------------------------------------------------ connection
    @property
    def address(self) -> str:
        """What receivers connect to: 'host:port' of the rendezvous store, or the disk directory."""
        if self._disk is not None:
            return str(self._disk.root)
        assert self._store is not None
        return f"{self.config.host}:{self._store.port}"

    def connect(self, timeout_s: float | None = None) -> list[Hello]:
        """Wait for every receiver (up to ``timeout_s``, default max(wire timeout, 300 s): engines may take
        minutes to start), build the groups, allocate and (ipc/shm) share the buffers once."""
        if self._state != "new":
            raise TransportError(f"connect() was already called (state {self._state})")
        if self._disk is not None:
            self._state = "idle"
            return []
        cfg, store = self.config, self._store
        assert store is not None
        keys = [f"{PREFIX}/hello/{r}" for r in range(1, self.world_size)]
        wait_s = max(cfg.timeout_s, 300.0) if timeout_s is None else timeout_s
        try:
            store.wait(keys, timedelta(seconds=wait_s))
        except Exception as e:
            arrived = [r for r in range(1, self.world_size) if store.check([f"{PREFIX}/hello/{r}"])]
            raise TransportError(
                f"[rank 0] connect: expected {self.num_receivers} receivers at {self.address} within "
                f"{wait_s:.0f} s, got ranks {arrived}: {e}"
            ) from e
        self.peers = [Hello.from_json(store.get(k)) for k in keys]
        device = torch.device(cfg.buffer_device())
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        self.device = device
        self.shim = device_shim(device)
        prepare_checksum(device)
        peers = "the receivers " + ", ".join(p.describe() for p in self.peers)
        ctl = make_group("gloo", store, f"{PREFIX}/ctl", 0, self.world_size, cfg.timeout_s)
        self._channel = Channel(ctl, 0, self.world_size, cfg.timeout_s, peers)
        nbytes = cfg.bucket_bytes + TRAILER_BYTES
        status = RankStatus(rank=0, ok=True, phase="connect")
        if cfg.backend in ("nccl", "gloo"):
            data = make_group(cfg.backend, store, f"{PREFIX}/data", 0, self.world_size, cfg.timeout_s)
            self._channel.add_group(data)
            self._buffers = allocate_buffers(cfg.num_buffers, nbytes, device)
            self._plane = BroadcastSenderPlane(self._channel, data, self._buffers, self.shim)
            warm_up(self._channel, data, device)
        else:
            status = self._connect_shared(store, nbytes)
        try:
            statuses = self._channel.exchange_status(status)
        finally:
            # Every receiver has mapped the files (or failed): the names are no longer needed.
            unlink_shm_buffers(self._shm_handles)
        raise_agreed(statuses, "connect", self.world_size)
        if self._control:
            self._channel.use_links(self._control)  # control messages over the sockets from here on
        if self._plane is not None and self._zc is None:
            self._packer = BucketPacker(self._plane, self._buffers, self._channel, self.shim, self.device,
                                        cfg.checksum)
        self._state = "idle"
        log.info("[rank 0] connected %d receiver(s) over %s at %s", self.num_receivers, cfg.backend, self.address)
        return self.peers

    def _connect_shared(self, store: Any, nbytes: int) -> RankStatus:
        """shm / ipc: share the buffers (or the zero-copy exporter) and accept every receiver's links
        (:func:`share_with_receivers`). Returns this rank's connect status."""
        assert self._channel is not None
        side = SharedSide()
        try:
            share_with_receivers(self.config, store, self.device, self.num_receivers, nbytes, side)
        except Exception as e:
            return status_of(0, "connect", e)
        finally:
            # Kept even after a failure: close() unlinks the files and closes the links made.
            self._buffers, self._shm_handles, self._zc = side.buffers, side.shm_handles, side.zc
            self._links, self._control = side.links, side.control
        for link in (*self._links.values(), *self._control.values()):
            self._channel.on_fail(link.close)
        self._plane = SharedSenderPlane(self._channel, self._links, self._buffers, self.shim, side.events)
        failed = {r: h.get("error") for r, h in side.hellos.items() if not h.get("ok", False)}
        if failed:
            log.info("[rank 0] connect: receivers reported failures %s", failed)
        return RankStatus(rank=0, ok=True, phase="connect")

    @property
    def zero_copy_stats(self) -> dict[str, int]:
        """Zero-copy only: storages exported and still live ('regions'), exports since connect ('exported')."""
        if self._zc is None:
            return {}
        return {"regions": len(self._zc.exporter), "exported": self._zc.exporter.exported}

    # ------------------------------------------------------------------ lifecycle
    def _require(self, *states: str) -> None:
        if self._state not in states:
            raise TransportError(f"[rank 0] expected state {'/'.join(states)}, the sender is {self._state}")
        if self._channel is not None:
            self._channel.check()

    def _naming_the_unresponsive(self) -> contextlib.AbstractContextManager[None]:
        """A communication failure of the wrapped call raised as a timeout naming the receivers gone."""
        return naming_unresponsive(self._channel, self._store, self.peers, self.config.timeout_s)

    def start_weight_update(self, manifest: Manifest | Iterable[TensorMeta], version: Any = None, *,
                            delta: dict[str, Any] | None = None) -> Manifest:
        """Announce an update: the manifest goes first and every receiver validates it against its model
        before anything is written. The manifest must be in block order (see ``check_block_order``);
        tensors must then be produced in its order. Returns the manifest as sent (checksums dropped).
        ``delta`` is delta sync's start record (``transport/delta_sync.py``), not for direct use."""
        with self._naming_the_unresponsive():
            return self._start_weight_update(manifest, version, delta)

    def _start_weight_update(self, manifest: Manifest | Iterable[TensorMeta], version: Any,
                             delta: dict[str, Any] | None = None,
                             during: Callable[[], None] | None = None,
                             fuse: Callable[[], bool] | None = None, defer: bool = False) -> Manifest:
        self._require("idle")
        if self._delta is not None and delta is None:
            self._delta.forget()  # an update outside send(): the base no longer follows the engines
        if not isinstance(manifest, Manifest):
            manifest = Manifest(tuple(manifest), version=version)
        version = version if version is not None else (manifest.version if manifest.version is not None else self._seq + 1)
        given = manifest.tensors
        reuse = self._agreed_manifest
        if reuse is not None and (given is reuse[0] or given == reuse[0]):
            # The same tensors as an update every receiver already accepted: no re-encoding, no rebuild.
            manifest = reuse[1].with_version(version)
        else:
            reuse = None
            manifest = Manifest(tuple(TensorMeta(m.name, m.dtype, m.shape) for m in given), version=version)
            check_block_order(manifest.names)
            for m in manifest:
                dtype_to_str(m.dtype)  # every dtype must have a wire name
            if self._zc is not None:
                self._zc.exporter.forget_tables()
        self._seq += 1
        self._manifest, self._version, self._pos, self._call = manifest, version, 0, 0
        self._t_start = time.perf_counter()
        self._transfer_s = 0.0
        self._call_s = 0.0
        self._num_buckets = 0
        if self._channel is not None:
            self._stats_at_start = dict(self._channel.stats)
        if self._disk is not None:
            self._disk.start(manifest, version, self._seq)
            self._state = "open"
            return manifest
        assert self._channel is not None and self._store is not None
        # A store key lets idle receivers wait for the next update without a pending collective.
        self._store.set(f"{PREFIX}/start/{self._seq}", "1")
        if self._seq > 1:
            self._store.delete_key(f"{PREFIX}/start/{self._seq - 1}")
        # Zero-copy: storages that died since the last header (an update committed in its call has no
        # finish header to carry them) are released first.
        releases = self._zc.exporter.releases() if self._zc is not None else None
        if fuse is not None and delta is None and reuse is not None and fuse():
            return self._start_with_call(manifest, version, reuse[2], releases)
        if defer and delta is None and reuse is not None and self._zc is None:
            # One receiver, buffered: the start header goes out as the call's header (``call_in_start``),
            # when the call announces itself (after queueing bucket 0's packing).
            self._deferred_start = reuse[2]
            self._state = "open"
            return manifest
        if reuse is not None:
            header = ControlHeader(kind="start", seq=self._seq, version=version, reuse_manifest_of=reuse[2],
                                   delta=delta, zero_copy=releases)
        else:
            header = ControlHeader(kind="start", seq=self._seq, version=version, manifest=manifest.to_json(),
                                   delta=delta, zero_copy=releases)
        self._channel.broadcast_bytes(header.to_json().encode(), "start_weight_update")
        if during is not None:
            during()  # host work that overlaps the receivers' validation of the manifest
        statuses = self._channel.exchange_status(RankStatus(rank=0, ok=True, phase="start_weight_update"))
        self._state = "open"
        try:
            raise_agreed(statuses, "start_weight_update", self.world_size)
        except BaseException:
            self._state = "idle"
            self._agreed_manifest = None
            raise
        if reuse is None:
            self._agreed_manifest = (given, manifest, self._seq)
        if delta is not None and delta.get("mode") == "delta":
            # The buckets carry each tensor's encoding: they are cut from the encoded sizes.
            self._manifest = wire_manifest(manifest, delta["wire"])
        return manifest

    def _start_with_call(self, manifest: Manifest, version: Any, reuse_of: int,
                         releases: dict[str, Any] | None) -> Manifest:
        """The start header carrying the whole call (zero-copy ``send()`` to one receiver of an agreed
        manifest, its tensors produced and tabled already): no start status exchange; the call's
        exchange decides both."""
        assert self._zc is not None and self._channel is not None and self._zc.early is not None
        n = len(manifest)
        table = self._zc.early[3]
        self._call += 1
        self._zc.produced()
        zero_copy = self._zc.exporter.payload((0, n), [], table)
        zero_copy.update({k: v for k, v in (releases or {}).items() if v})  # (payload released none since)
        header = ControlHeader(kind="start", seq=self._seq, version=version, call_in_start=True, call=self._call,
                               first=0, count=n, then_finish=True, zero_copy=zero_copy, reuse_manifest_of=reuse_of)
        self._channel.broadcast_bytes(header.to_json().encode(), "start_weight_update")
        self._state = "open"
        self._fused_call = True
        return manifest

    def _call_metas(self, names: Iterable[str] | None) -> tuple[int, int]:
        assert self._manifest is not None
        total = len(self._manifest)
        if names is None:
            return self._pos, total - self._pos
        names = list(names)
        expected = list(self._manifest.names[self._pos : self._pos + len(names)])
        if names != expected:
            first = next((i for i, (a, b) in enumerate(zip(names, expected)) if a != b), len(expected))
            got = names[first] if first < len(names) else "<end>"
            want = expected[first] if first < len(expected) else "<end of manifest>"
            raise ManifestError(
                f"update_weights(names=...) must continue the manifest in order at position "
                f"{self._pos + first}: expected {want!r}, got {got!r}"
            )
        return self._pos, len(names)

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        names: Iterable[str] | None = None,
    ) -> int:
        """Send the next run of the manifest: ``names`` (default: everything not yet sent), produced by
        ``named_tensors`` in manifest order (a mapping is read in manifest order). Returns the count."""
        t0 = time.perf_counter()
        try:
            with self._naming_the_unresponsive():
                return self._update_weights(named_tensors, names)
        finally:
            self._call_s += time.perf_counter() - t0

    def _update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        names: Iterable[str] | None,
    ) -> int:
        self._require("open")
        assert self._manifest is not None
        local_error: BaseException | None = None
        try:
            first, count = self._call_metas(names)
        except ManifestError as e:
            first, count, local_error = self._pos, 0, e
        metas = self._manifest.tensors[first : first + count]
        if isinstance(named_tensors, Mapping):
            mapping = named_tensors
            named_tensors = ((m.name, mapping.get(m.name)) for m in metas)  # type: ignore[misc]
        t0 = time.perf_counter()
        if self._disk is not None:
            it = iter(named_tensors)
            try:
                if local_error is not None:
                    raise local_error
                sent = self._disk.write_call(metas, Checked(it, metas, first))
            except BaseException:
                close_source(it, named_tensors)
                self._disk.abort()
                self._state = "idle"
                raise
            self._pos += count
            self._transfer_s += time.perf_counter() - t0
            return sent
        if self._zc is not None:
            return self._zero_copy_call(named_tensors, metas, first, local_error)
        layout = self._layouts.get(self._manifest.tensors, first, count)
        self._call += 1
        assert self._channel is not None and self._plane is not None
        deferred, self._deferred_start = self._deferred_start, None
        if deferred is not None:  # the start rides in this call's header (see _start_weight_update)
            header = ControlHeader(kind="start", seq=self._seq, version=self._version, reuse_manifest_of=deferred,
                                   call_in_start=True, call=self._call, first=first, count=count,
                                   num_buckets=layout.num_buckets, then_finish=self._finishes_after(first, count))
        else:
            header = ControlHeader(kind="call", seq=self._seq, call=self._call, first=first, count=count,
                                   num_buckets=layout.num_buckets, then_finish=self._finishes_after(first, count))
        channel = self._channel

        def announce() -> None:
            channel.broadcast_bytes(header.to_json().encode(), "update_weights")

        if local_error is None:
            it = iter(named_tensors)
            try:
                assert self._packer is not None
                local_error = self._packer.send_call(layout, it, first, announce, self._seq, self._call,
                                                     self._version)
            except BaseException:
                close_source(it, named_tensors)
                raise
            if local_error is not None:
                close_source(it, named_tensors)
        else:
            announce()
            close_source(None, named_tensors)
        self._transfer_s += time.perf_counter() - t0
        self._num_buckets += layout.num_buckets
        self._pos += count
        try:
            self._settle_call(self._channel.exchange_status(status_of(0, "update_weights", local_error)), local_error)
        except BaseException:
            if deferred is not None:
                self._agreed_manifest = None  # refused, maybe: the next start sends the manifest again
            raise
        return count

    def _finishes_after(self, first: int, count: int) -> bool:
        """Whether this call is the last of a ``send``: it ends the manifest and the finish follows."""
        assert self._manifest is not None
        return self._then_finish and first + count == len(self._manifest)

    def _settle_call(self, statuses: list[RankStatus], error: BaseException | None) -> None:
        """Raise the call's agreed failure, if any rank failed; then every receiver aborted its update
        (rolled back or torn) and this sender is idle again. When every receiver also committed in the
        exchange (a ``then_finish`` call), the statuses are kept for ``send``'s report."""
        try:
            raise_agreed(statuses, "update_weights", self.world_size, local=error)
        except BaseException:
            if self._zc is not None:
                self._zc.exporter.reset()  # a receiver may lack regions: both sides start over
            self._state = "idle"
            raise
        self._folded = statuses if self._then_finish and all_folded(statuses) else None

    def _zero_copy_call(self, named_tensors: Iterable[tuple[str, torch.Tensor]], metas: tuple[TensorMeta, ...],
                        first: int, error: BaseException | None) -> int:
        """One call without buffers: the header carries where each tensor lies in the exported storages.

        The call's tensors are held until every receiver reported its loads complete.
        """
        zc, channel = self._zc, self._channel
        assert zc is not None and channel is not None and self._manifest is not None
        t0 = time.perf_counter()
        if self._fused_call:
            # The start header carried this call: only its status exchange is left (the receiver's verdict
            # on the manifest, its loads and its folded commit vote).
            held, self._fused_call, zc.early = zc.early, False, None  # held until the receiver reported
            statuses = channel.exchange_status(status_of(0, "update_weights", error))
            del held
            self._transfer_s += time.perf_counter() - t0
            self._pos += len(metas)
            try:
                self._settle_call(statuses, error)
            except BaseException:
                self._agreed_manifest = None  # refused, maybe: the next start sends the manifest again
                raise
            return len(metas)
        self._call += 1
        tensors, regions, table, error = zc.call(named_tensors, metas, first,
                                                 first == 0 and len(metas) == len(self._manifest), error)
        if error is not None:
            log.error("[rank 0] update %r: zero-copy call %d failed: %s", self._version, self._call, error)
        header = ControlHeader(kind="call", seq=self._seq, call=self._call, first=first, count=len(metas),
                               then_finish=self._finishes_after(first, len(metas)),
                               zero_copy=zc.exporter.payload((first, len(metas)), regions, table))
        channel.broadcast_bytes(header.to_json().encode(), "update_weights")
        statuses = channel.exchange_status(status_of(0, "update_weights", error))
        del tensors  # held until every receiver reported its loads complete
        self._transfer_s += time.perf_counter() - t0
        self._pos += len(metas)
        self._settle_call(statuses, error)
        return len(metas)

    def finish_weight_update(self) -> TransferReport:
        """Commit on every receiver (all or none report success) and return the transfer report."""
        with self._naming_the_unresponsive():
            return self._finish_weight_update()

    def _finish_weight_update(self) -> TransferReport:
        self._require("open")
        assert self._manifest is not None
        if self._disk is not None:
            local: BaseException | None = None
            if self._pos != len(self._manifest):
                local = ManifestError(
                    f"finish_weight_update: {len(self._manifest) - self._pos} announced tensors were never sent"
                )
                self._disk.abort()
                self._state = "idle"
                raise local
            self._disk.finish()
            self._state = "idle"
            return self._report([])
        assert self._channel is not None
        # Zero-copy: storages that died during the update (the source's temporaries) are released now.
        header = ControlHeader(kind="finish", seq=self._seq,
                               zero_copy=self._zc.exporter.releases() if self._zc else None)
        self._channel.broadcast_bytes(header.to_json().encode(), "finish_weight_update")
        self._state = "idle"
        # One exchange: receivers prepared (every check that can fail) before it and commit after it.
        statuses = self._channel.exchange_status(RankStatus(rank=0, ok=True, phase="finish_weight_update"))
        raise_agreed(statuses, "finish_weight_update", self.world_size)
        return self._finished(statuses)

    def _finished(self, statuses: list[RankStatus]) -> TransferReport:
        """The update committed on every receiver (in the finish's exchange or its last call's)."""
        self._state = "idle"
        if self.config.backend == "ipc":
            if self._zc is not None:
                self._zc.collect()  # once regions came or went
            else:
                torch.cuda.ipc_collect()  # free exports whose importers are gone; our buffers stay referenced
        return self._report([{k: v for k, v in s.report.items() if k != FOLDED} for s in statuses[1:]])

    def _report(self, receivers: list[dict[str, Any]]) -> TransferReport:
        assert self._manifest is not None
        stats = {} if self._channel is None else {
            k: v - self._stats_at_start.get(k, 0) for k, v in self._channel.stats.items()
        }
        return TransferReport(
            version=self._version, backend=self.config.backend, num_tensors=len(self._manifest),
            num_bytes=self._manifest.nbytes, num_buckets=self._num_buckets,
            seconds=time.perf_counter() - self._t_start, transfer_seconds=self._transfer_s,
            call_seconds=self._call_s,
            receivers=receivers, host_waits=stats,
        )

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
             manifest: Manifest | Iterable[TensorMeta], version: Any = None) -> TransferReport:
        """``start_weight_update`` + one ``update_weights`` + ``finish_weight_update``.

        With ``TransportConfig(delta=True)``: a delta on the engines' committed base when possible,
        falling back to a full update on its own (``transport/delta_sync.py``)."""
        if self._delta is not None:
            return self._delta.send(self, named_tensors, manifest, version)
        early = self._zc is not None and self._disk is None
        # One receiver: a call ready before the start (the last send's tensors again) rides in its header.
        one = self.world_size == 2 and self._disk is None
        zc = self._zc
        fuse: Callable[[], bool] | None = None
        during: Callable[[], None] | None = None
        if zc is not None and early:
            # The call is produced before the start header when it repeats the last one (and then rides
            # in it, to one receiver), else while the receivers validate the manifest.
            def during() -> None:
                assert zc is not None and self._manifest is not None
                zc.produce(named_tensors, self._manifest)

            def repeat() -> bool:
                assert zc is not None and self._manifest is not None
                return zc.repeat(named_tensors, self._manifest)

            fuse = repeat if one else None
        try:
            with self._naming_the_unresponsive():
                self._start_weight_update(manifest, version, during=during, fuse=fuse, defer=one)
        except BaseException:
            if zc is not None:
                zc.drop_early(named_tensors)
            raise
        # The call announces the finish: receivers running the whole update (receive_update) prepare the
        # commit and vote on it in the call's exchange, and when all did, it was the finish's round trip.
        self._then_finish, self._folded = True, None
        try:
            self.update_weights(named_tensors)
        finally:
            self._then_finish = False
        folded, self._folded = self._folded, None
        if folded is not None:
            return self._finished(folded)
        return self.finish_weight_update()

    def close(self) -> None:
        """Release buffers and groups (local; receivers close on their own)."""
        if self._state == "closed":
            return
        unlink_shm_buffers(self._shm_handles)
        if self.shim.is_cuda:
            torch.cuda.synchronize(self.device)
        self._plane = None
        self._zc = None  # receivers release their imports when they close
        self._packer = None  # its checksum intermediates go with the buffers
        self._buffers = []
        for link in (*self._links.values(), *self._control.values()):
            link.close()
        self._links, self._control = {}, {}
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.config.backend == "ipc" and torch.cuda.is_available():
            torch.cuda.ipc_collect()
        self._store = None
        self._state = "closed"

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

