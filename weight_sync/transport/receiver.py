"""WeightReceiver: the engine side of a transport, feeding an UpdateSession of the engine's model.

``WeightReceiver(engine_or_model, address, rank)`` -> ``connect()`` (reads the sender's wire
parameters, joins the groups, allocates or imports the buffers once) -> per update
``start_weight_update()`` (receives and validates the manifest: a bad one is rejected before any write)
-> ``update_weights()`` once per sender call -> ``finish_weight_update()`` (commits, returns the
UpdateReport) -> ``close()``. ``receive_update()`` runs a whole update however many calls the sender
makes.

A receiver that fails mid-call (checksum, load error) stops loading but keeps receiving the call's
buckets, so the sender and the other receivers are never left waiting; at the call's status exchange
every rank raises the same error and the session is aborted (rolled back bitwise with ``rollback=True``,
otherwise the model is marked torn and refuses to serve). An engine that fails the update itself,
before this receiver took the sender's call, ends it the same way with ``abort_weight_update(error)``.
A dead or silent peer raises within the timeout and breaks the transport; from connect to close a
heartbeat (``liveness``) lets the sender name this receiver if its process dies or is stopped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from weight_sync.checksum import prepare_checksum
from weight_sync.errors import TransportError, TransportTimeout, UpdateStateError
from weight_sync.layers.streams import device_shim
from weight_sync.manifest import Manifest
from weight_sync.transport.buffers import (
    allocate_buffers,
    device_uuid,
    import_ipc_buffer,
    open_shm_buffer,
)
from weight_sync.transport.checks import BucketChecks
from weight_sync.transport.config import VERIFY_MODES
from weight_sync.transport.consumer import BucketConsumer
from weight_sync.transport.delta_sync import DeltaSession, ReceiverDeltaBase, is_delta_refusal
from weight_sync.transport.disk import DiskReader
from weight_sync.transport.doorbell import Link, connect_doorbell
from weight_sync.transport.group import Channel, Deadline, join_store, make_group, poll, warm_up
from weight_sync.transport.layout import LayoutCache
from weight_sync.transport.liveness import Heartbeat
from weight_sync.transport.planes import BroadcastReceiverPlane, SharedReceiverPlane
from weight_sync.transport.status import raise_agreed, status_of
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

__all__ = ["WeightReceiver"]

log = logging.getLogger(__name__)

PREFIX = "weight_sync"


def _target_model(target: Any) -> nn.Module:
    model = getattr(target, "model", target)
    if not isinstance(model, nn.Module):
        raise TypeError(f"WeightReceiver needs an engine with .model or an nn.Module, got {type(target).__name__}")
    return model


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


class WeightReceiver:
    """Engine side of a transport; see the module docstring for the lifecycle.

    target: an engine with ``begin_update(manifest, **options)`` (e.g. ReferenceEngine) or an nn.Module.
    address: the sender's ``address`` ('host:port', or the directory for the disk backend).
    rank: this receiver's rank in [1, num_receivers]. rollback / budget_bytes / fingerprint /
    allow_partial: options of the update session (see :func:`weight_sync.begin_update`).
    """

    def __init__(
        self,
        target: Any,
        address: str,
        rank: int = 1,
        *,
        device: str | torch.device | None = None,
        rollback: bool = False,
        budget_bytes: int | None = None,
        fingerprint: bool = True,
        allow_partial: bool = False,
        connect_timeout_s: float = 300.0,
        backend: str | None = None,
    ) -> None:
        self.target = target
        self.model = _target_model(target)
        self.address = address
        self.rank = rank
        self.device = torch.device(device) if device is not None else _model_device(self.model)
        self.session_options = dict(rollback=rollback, budget_bytes=budget_bytes, fingerprint=fingerprint,
                                    allow_partial=allow_partial)
        self.connect_timeout_s = connect_timeout_s
        self.backend = backend
        self.params: WireParams | None = None
        self.last_report: Any = getattr(target, "last_report", None)
        self.weight_version: Any = getattr(self.last_report, "version", None)
        self._state = "new"
        self._seq = 0
        self._session: Any = None
        self._manifest: Manifest | None = None
        self._manifests: dict[int, Manifest] = {}  # the last manifest received in full, by update seq
        self._channel: Channel | None = None
        self._plane: BroadcastReceiverPlane | SharedReceiverPlane | None = None
        self._buffers: list[torch.Tensor] = []
        self._consumer: BucketConsumer | None = None  # the bucket loop (not with zero-copy), set at connect
        # Each bucket's trailer and checksum, recorded on the device and read back per call; set at connect.
        self._checks: BucketChecks | None = None
        self._layouts: LayoutCache | None = None  # bucket layouts by call, set at connect
        self._link: Link | None = None
        self._zc: RegionImporter | None = None  # zero-copy: the sender's storages, imported once
        self._zc_event: Any = None  # zero-copy ipc: the sender's "tensors produced" event
        self._store: Any = None
        self._disk: DiskReader | None = None
        self._heartbeat: Heartbeat | None = None
        self._stats_at_start: dict[str, int] = {}
        # Delta sync: a host copy of the last committed update, made once a sender asks for it.
        self._delta_base: ReceiverDeltaBase | None = None

    # ------------------------------------------------------------------ connection
    def connect(self) -> WireParams | None:
        """Join the sender's transport; returns the wire parameters the sender decided."""
        if self._state != "new":
            raise TransportError(f"[rank {self.rank}] connect() was already called (state {self._state})")
        if self.backend == "disk" or (self.backend is None and os.path.isdir(self.address)):
            self._disk = DiskReader(self.address)
            self._state = "idle"
            return None
        store = join_store(self.address, self.connect_timeout_s)
        self._store = store
        try:
            params = WireParams.from_json(store.get(f"{PREFIX}/wire"))
        except TransportError:
            raise
        except Exception as e:
            raise TransportError(f"[rank {self.rank}] connect: no wire parameters from {self.address}: {e}") from e
        if not 1 <= self.rank < params.world_size:
            raise TransportError(
                f"[rank {self.rank}] connect: rank must be in [1, {params.world_size - 1}] for a sender "
                f"expecting {params.world_size - 1} receivers, got {self.rank}"
            )
        if params.verify not in VERIFY_MODES:
            raise TransportError(
                f"[rank {self.rank}] connect: the sender asks for verify={params.verify!r}; this receiver knows "
                f"{list(VERIFY_MODES)}"
            )
        self.params = params
        self._layouts = LayoutCache(params.bucket_bytes, params.align_bytes)
        device = self.device
        if params.backend in ("nccl", "ipc"):
            if device.type != "cuda":
                raise TransportError(
                    f"[rank {self.rank}] backend {params.backend!r} needs the engine on a CUDA device, got {device}"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        self.buffer_device = device
        self.shim = device_shim(device)
        prepare_checksum(device)
        hello = Hello(rank=self.rank, host=socket.gethostname(), pid=os.getpid(), device=str(device),
                      device_uuid=device_uuid(device) if device.type == "cuda" else None)
        store.set(f"{PREFIX}/hello/{self.rank}", hello.to_json())
        ctl = make_group("gloo", store, f"{PREFIX}/ctl", self.rank, params.world_size, params.timeout_s)
        self._channel = Channel(ctl, self.rank, params.world_size, params.timeout_s, "the sender (rank 0)")
        self._checks = BucketChecks(self.rank, params.checksum, self._channel, self.shim)
        nbytes = params.bucket_bytes + TRAILER_BYTES
        error: BaseException | None = None
        if params.backend in ("nccl", "gloo"):
            data = make_group(params.backend, store, f"{PREFIX}/data", self.rank, params.world_size, params.timeout_s)
            self._channel.add_group(data)
            self._buffers = allocate_buffers(params.num_buffers, nbytes, device)
            self._plane = BroadcastReceiverPlane(self._channel, data, self._buffers, self.shim)
            warm_up(self._channel, data, device)
        else:
            events: list[Any] | None = None
            try:
                if params.zero_copy:
                    self._zc = RegionImporter(params.backend, self.rank, device)
                    if params.backend == "ipc":
                        handle = json.loads(store.get(f"{PREFIX}/events"))[0]
                        self._zc_event = torch.cuda.Event.from_ipc_handle(device, b64decode(handle))
                elif params.backend == "shm":
                    raw = json.loads(store.get(f"{PREFIX}/buffers"))
                    self._buffers = [open_shm_buffer(ShmBufferHandle.from_dict(d)) for d in raw]
                else:
                    raw = json.loads(store.get(f"{PREFIX}/buffers/{self.rank}"))
                    self._buffers = [import_ipc_buffer(IpcBufferHandle.from_dict(d)) for d in raw]
                    # The sender's packing events (one per buffer): our compute stream waits on them.
                    handles = json.loads(store.get(f"{PREFIX}/events"))
                    events = [torch.cuda.Event.from_ipc_handle(self._buffers[0].device, b64decode(h))
                              for h in handles]
                if self._buffers:
                    prepare_checksum(self._buffers[0].device)  # an IPC import may be another device index
                expected = 0 if params.zero_copy else params.num_buffers
                if len(self._buffers) != expected or any(b.numel() != nbytes for b in self._buffers):
                    raise TransportError(
                        f"[rank {self.rank}] connect: expected {expected} shared buffers of {nbytes} "
                        f"bytes, got {[b.numel() for b in self._buffers]}"
                    )
            except Exception as e:
                error = e
            try:
                # Always open the doorbell, even after a failure above: the hello carries the outcome, so
                # the sender is not left waiting for this receiver's link until its timeout.
                info = json.loads(store.get(f"{PREFIX}/doorbell"))
                outcome = {"ok": error is None, "error": None if error is None else f"{type(error).__name__}: {error}"}
                self._link = connect_doorbell(info, self.rank, outcome, params.timeout_s)
                self._channel.on_fail(self._link.close)
            except Exception as e:
                error = error or e
            self._plane = SharedReceiverPlane(self._channel, self._link, self._buffers, self.shim, events)
        if self._plane is not None and self._zc is None:
            self._consumer = BucketConsumer(self.rank, self._plane, self._buffers, self._checks, device,
                                            params.verify == "deferred", bool(self.session_options["rollback"]))
        statuses = self._channel.exchange_status(status_of(self.rank, "connect", error))
        raise_agreed(statuses, "connect", params.world_size, local=error)
        # From here on the sender can tell this rank's death (or SIGSTOP) from a slow peer, and name it.
        self._heartbeat = Heartbeat(self.address, self.rank, params.timeout_s)
        self._state = "idle"
        log.info("[rank %d] connected to %s over %s", self.rank, self.address, params.backend)
        return params

    # ------------------------------------------------------------------ control messages
    def _header(self, phase: str, timeout_s: float | None = None) -> ControlHeader:
        assert self._channel is not None
        raw = self._channel.broadcast_bytes(None, phase, timeout_s)
        header = ControlHeader.from_json(raw)
        if header.seq != self._seq + (1 if header.kind == "start" else 0):
            msg = f"[rank {self.rank}] {phase}: the sender is at update {header.seq}, this receiver at {self._seq}"
            self._channel.fail(msg)
            raise TransportError(msg)
        return header

    def _handle(self, header: ControlHeader, wanted: str, error: BaseException | None = None) -> Any:
        """Run the protocol of ``header`` (as a failing rank if it is not what the caller asked for, or
        when ``error`` says this rank already failed)."""
        if error is None and header.kind != wanted:
            error = UpdateStateError(
                f"[rank {self.rank}] {wanted} was called while the sender is in {header.kind}"
            )
        try:
            if header.zero_copy is not None and self._zc is not None:
                # Regions whose storage died on the sender (or all, after a failure) go before anything.
                self._zc.drop(header.zero_copy.get("drop"), reset=bool(header.zero_copy.get("reset")))
            if header.kind == "start":
                return self._on_start(header, error)
            if header.kind == "call":
                return self._on_call(header, error)
            if header.kind == "finish":
                return self._on_finish(error)
            raise TransportError(f"[rank {self.rank}] unexpected control header {header.kind!r}")
        except BaseException as e:
            self._abort_session(f"{type(e).__name__}: {e}")
            raise

    def _abort_session(self, reason: str) -> None:
        if self._session is not None:
            try:
                if not self._device_drained():
                    # A rollback would queue its copies behind work that never completes (a dead peer's
                    # packing or collective) and then synchronize without a deadline: mark torn instead.
                    reason = f"{reason}; the device stream did not drain, so the update cannot be rolled back"
                    self._session.rollback = False
                self._session.abort(reason)
            finally:
                self._session = None
                self._state = "idle"

    def _device_drained(self) -> bool:
        """Whether the compute stream finishes its queued work within the timeout (always, off CUDA).

        With deferred verification the compute stream may hold loads queued behind receives (or, ipc,
        behind the sender's packing) when a failure is raised; a broken channel has aborted its groups,
        which ends stuck collectives, so this normally returns at once.
        """
        shim = getattr(self, "shim", None)
        if shim is None or not shim.is_cuda:
            return True
        ev = shim.event()
        ev.record(shim.current_stream())
        timeout = self.params.timeout_s if self.params is not None else 60.0

        class _Stuck(Exception):
            pass

        try:
            poll(ev.query, Deadline(timeout), _Stuck)
        except _Stuck:
            log.error("[rank %d] the device did not drain within %.1f s", self.rank, timeout)
            if self._channel is not None:
                self._channel.fail(f"[rank {self.rank}] the device stream is stuck behind a transfer")
            return False
        return True

    @property
    def is_open(self) -> bool:
        """Whether an update is open on this receiver (started, neither finished nor aborted)."""
        return self._state == "open"

    def _require(self, *states: str) -> None:
        if self._state not in states:
            raise UpdateStateError(f"[rank {self.rank}] expected state {'/'.join(states)}, receiver is {self._state}")
        if self._channel is not None:
            self._channel.check()

    # ------------------------------------------------------------------ lifecycle
    def start_weight_update(self, timeout_s: float | None = None) -> Manifest:
        """Wait (up to ``timeout_s``, default the wire timeout) for the sender's manifest and validate it.

        A timeout here leaves the transport usable: waiting for the next update can simply be retried.
        """
        self._require("idle")
        if self._disk is not None:
            self._manifest, version = self._disk.start(timeout_s or 300.0)
            self._session = self._begin(self._manifest, version)
            self._state = "open"
            return self._manifest
        assert self.params is not None and self._store is not None
        wait_s = self.params.timeout_s if timeout_s is None else timeout_s
        key = f"{PREFIX}/start/{self._seq + 1}"
        try:
            self._store.wait([key], timedelta(seconds=wait_s))
        except Exception as e:
            if isinstance(e, TimeoutError) or "timeout" in str(e).lower() or "Timeout" in type(e).__name__:
                raise TransportTimeout(
                    f"[rank {self.rank}] start_weight_update: no update from the sender (rank 0) within {wait_s:.1f} s"
                ) from e
            msg = f"[rank {self.rank}] start_weight_update: the sender's store at {self.address} is gone: {e}"
            assert self._channel is not None
            self._channel.fail(msg)
            raise TransportError(msg) from e
        return self._handle(self._header("start_weight_update"), "start")

    def _begin(self, manifest: Manifest, version: Any) -> Any:
        opts = dict(self.session_options, version=version)
        begin = getattr(self.target, "begin_update", None)
        if begin is not None and callable(begin):
            return begin(manifest, **opts)
        from weight_sync.reload.api import begin_update

        return begin_update(self.model, manifest, **opts)

    def _on_start(self, header: ControlHeader, error: BaseException | None) -> Manifest:
        assert self._channel is not None
        self._stats_at_start = dict(self._channel.stats)
        self._seq = header.seq
        if header.manifest is not None:
            manifest = Manifest.from_json(header.manifest)
            self._manifests[header.seq] = manifest
            if self._zc is not None:
                self._zc.forget_views()  # the sender forgot its tables with the old manifest
            for old in [k for k in self._manifests if k != header.seq]:
                del self._manifests[old]
        else:
            cached = self._manifests.get(header.reuse_manifest_of)  # type: ignore[arg-type]
            if cached is None:
                msg = (f"[rank {self.rank}] start_weight_update: the sender reuses the manifest of update "
                       f"{header.reuse_manifest_of}, which this receiver does not hold")
                self._channel.fail(msg)
                raise TransportError(msg)
            manifest = Manifest(cached.tensors, version=header.version)
        if self._session is not None:
            self._abort_session("a new update started before the previous one finished")
        wire = None
        if header.delta is None and self._delta_base is not None:
            self._delta_base.invalidate()  # an update the base does not follow
        elif header.delta is not None and error is None:
            # Refused before any write unless the delta's base is exactly this engine's committed state.
            self._delta_base = self._delta_base or ReceiverDeltaBase()
            fingerprint = getattr(self.last_report, "fingerprint", None)
            try:
                wire = self._delta_base.check(header.delta, Manifest(manifest.tensors, version=header.version),
                                              self.rank, self.weight_version, fingerprint)
            except Exception as e:
                error = e
        if error is None:
            try:
                self._session = self._begin(manifest, header.version)
                if header.delta is not None and self._delta_base is not None:
                    self._session = DeltaSession(self._session, self._delta_base, header.delta.get("mode", "full"))
            except Exception as e:
                error = e
        self._manifest = wire or manifest
        self._version = header.version
        self._state = "open" if self._session is not None else "idle"
        statuses = self._channel.exchange_status(status_of(self.rank, "start_weight_update", error))
        raise_agreed(statuses, "start_weight_update", self._channel.size, local=error)
        return manifest

    def update_weights(self) -> int:
        """Receive one sender ``update_weights`` call into the open update; returns the tensors loaded."""
        self._require("open")
        if self._disk is not None:
            assert self._session is not None
            try:
                return self._disk.load_all(self._session)
            except BaseException as e:
                self._abort_session(f"{type(e).__name__}: {e}")
                raise
        return self._handle(self._header("update_weights"), "call")

    def abort_weight_update(self, error: BaseException) -> None:
        """End the open update because the engine failed it before this receiver took the sender's call.

        vLLM's worker ends its session when any step of ``update_weights`` raises (an ``update_info`` it
        rejects, an index past its workers), and the sender is then in the middle of that call, waiting
        for this rank. Ending only the local session would leave the sender waiting until its timeout
        and the two sides in different states. Instead this rank takes the sender's pending phase as a
        failing rank: it receives the call's buckets without loading them (so nobody is left in a
        collective), reports ``error`` in the call's status exchange, and every rank raises the same
        agreed error at once. The session is aborted by the usual rules (rolled back with ``rollback``,
        torn if anything was written, untouched otherwise) and both sides are idle, so the next
        ``start_weight_update`` works on this connection.

        Raises the agreed error (its cause: ``error``); a transport that cannot reach the sender (broken,
        disk) aborts the session locally and returns.
        """
        if self._state != "open":
            return
        reason = f"the engine ended the update: {type(error).__name__}: {error}"
        if self._disk is not None or self._channel is None or self._channel.broken is not None:
            self._abort_session(reason)
            return
        try:
            header = self._header("update_weights (ended by the engine)")
        except BaseException:
            self._abort_session(reason)  # no sender phase to join (it never came): the local session ends
            raise
        self._handle(header, header.kind, error)

    def _on_call(self, header: ControlHeader, error: BaseException | None) -> int:
        assert self._channel is not None and self._plane is not None and self.params is not None
        if self._manifest is None or self._session is None:
            error = error or UpdateStateError(f"[rank {self.rank}] update_weights arrived without an open update")
        assert self._layouts is not None  # set at connect
        if header.zero_copy is not None:
            return self._on_zero_copy_call(header, error)
        # Without a manifest (this rank has no open update) the call is planned as empty.
        layout = self._layouts.get(self._manifest.tensors if self._manifest else (), header.first, header.count)
        if layout.num_buckets != header.num_buckets:
            msg = (f"[rank {self.rank}] update_weights: the sender cut tensors {header.first}..."
                   f"{header.first + header.count} into {header.num_buckets} buckets, this receiver into "
                   f"{layout.num_buckets}; sender and receiver run different weight_sync versions")
            self._channel.fail(msg)
            raise TransportError(msg)
        assert self._consumer is not None  # set at connect (every backend but zero-copy and disk)
        loaded, error = self._consumer.consume_call(header, layout, self._session, self._version, error)
        statuses = self._channel.exchange_status(status_of(self.rank, "update_weights", error))
        raise_agreed(statuses, "update_weights", self._channel.size, local=error)
        return loaded

    def _on_zero_copy_call(self, header: ControlHeader, error: BaseException | None) -> int:
        """A call without buffers: import the new regions, load from the sender's memory in place."""
        assert self._channel is not None
        zc = header.zero_copy or {}
        table = zc.get("table")
        loaded = 0
        try:
            if self._zc is None:
                raise TransportError(f"[rank {self.rank}] a zero-copy call arrived on a transport without zero_copy")
            self._zc.add(zc.get("regions") or [])
            if table is None:
                self._zc.drop(None, reset=True)  # the sender failed: release this call's exports too
            elif error is None:
                metas = self._manifest.tensors[header.first : header.first + header.count]  # type: ignore[union-attr]
                loaded = load_in_place(self._zc, (header.first, header.count), zc, metas, self._session,
                                       self._channel, self._zc_event, self.shim)
        except Exception as e:
            error = error or e
            log.error("[rank %d] update %r: zero-copy call %d: %s", self.rank, self._version, header.call, e)
        statuses = self._channel.exchange_status(status_of(self.rank, "update_weights", error))
        raise_agreed(statuses, "update_weights", self._channel.size, local=error)
        return loaded

    def finish_weight_update(self) -> Any:
        """Commit the update (after every rank agreed that it is complete); returns the UpdateReport."""
        self._require("open")
        if self._disk is not None:
            session, self._session = self._session, None
            self._state = "idle"
            report = session.finish()
            self._committed(report)
            return report
        return self._handle(self._header("finish_weight_update"), "finish")

    def _on_finish(self, error: BaseException | None) -> Any:
        """Prepare the commit, agree on it in one exchange, then commit (or abort) on every rank alike.

        One round trip, two phases: everything of ``finish`` that can fail (completeness, pending
        processing, hooks, the pointer audit, the fingerprint) runs before the exchange, and only
        bookkeeping that cannot fail runs after it. So no rank commits while another fails, and the
        report travels in the same record as the vote.
        """
        assert self._channel is not None
        size = self._channel.size
        session = self._session
        if error is None and session is None:
            error = UpdateStateError(f"[rank {self.rank}] finish_weight_update without an open update")
        if error is None and not self.session_options["allow_partial"]:
            missing = session.missing()
            if missing:
                from weight_sync.errors import IncompleteUpdateError

                error = IncompleteUpdateError(
                    f"[rank {self.rank}] {len(missing)} announced tensor(s) never arrived: {missing[:5]}",
                    tuple(missing),
                )
        summary: dict[str, Any] = {}
        if error is None:
            try:
                session.prepare()  # a failure aborts the session (rolled back or torn)
                summary = {"rank": self.rank, **session.prepared_summary(), "transport": self.transport_stats()}
            except Exception as e:
                error = e
        statuses = self._channel.exchange_status(status_of(self.rank, "finish_weight_update", error, summary))
        # Any failure, here or elsewhere: _handle aborts this rank's session (a no-op if prepare did).
        raise_agreed(statuses, "finish_weight_update", size, local=error)
        self._session = None
        self._state = "idle"
        report = session.commit()
        self._committed(report)
        return report

    def transport_stats(self) -> dict[str, int]:
        """This receiver's host waits since the current (or last) update started, by kind (see
        ``Channel.stats``): e.g. 'readback' is 1 per update_weights call with deferred verification."""
        if self._channel is None:
            return {}
        return {k: v - self._stats_at_start.get(k, 0) for k, v in self._channel.stats.items()}

    @property
    def staging_bytes(self) -> int:
        """Bytes of the staging tensor that reassembles tensors split across buckets (0 if none yet)."""
        staging = None if self._consumer is None else self._consumer.staging
        return 0 if staging is None else staging.numel()

    @property
    def zero_copy_regions(self) -> int:
        """Zero-copy: how many of the sender's storages this receiver holds imported (0 otherwise)."""
        return 0 if self._zc is None else len(self._zc)

    def _committed(self, report: Any) -> None:
        self.weight_version = report.version
        self.last_report = report
        if hasattr(self.target, "last_report"):
            self.target.last_report = report

    def receive_update(self, timeout_s: float | None = None) -> Any:
        """Run one whole update (start, every call, finish) as the sender drives it; returns the report.

        A delta refused for its base is followed by the sender's full update at once: that one is run."""
        try:
            self.start_weight_update(timeout_s)
        except TransportError as e:
            if not is_delta_refusal(e):
                raise
            log.info("[rank %d] delta refused (%s); receiving the sender's full update", self.rank, e)
            self.start_weight_update(timeout_s)
        if self._disk is not None:
            self.update_weights()
            return self.finish_weight_update()
        while True:
            header = self._header("update_weights or finish_weight_update")
            if header.kind == "finish":
                return self._handle(header, "finish")
            self._handle(header, "call")

    def close(self) -> None:
        """Release imported buffers and groups (local: the sender closes on its own)."""
        if self._state == "closed":
            return
        self._abort_session("the receiver was closed mid-update")
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        # Nothing may still read the buffers when they are dropped (an IPC import is released with them);
        # a bounded wait, not torch.cuda.synchronize, which has no deadline.
        self._device_drained()
        self._plane = None
        if self._link is not None:
            self._link.close()
            self._link = None
        self._checks = None  # its device intermediates go with the buffers
        self._consumer = None  # its views of the buffers and its staging go with them
        self._buffers = []  # drops the single import of each IPC buffer (its reference is released)
        if self._zc is not None:
            self._zc.close()  # zero-copy: releases every import of the sender's storages
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._store = None
        self._state = "closed"

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
