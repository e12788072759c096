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

This module holds the protocol's states (which update is open, which phase the sender is in, the
status exchanges that make every rank agree); how a call's bytes become session loads is the
:class:`~weight_sync.transport.receiver_link.ReceiverLink`'s job (buffers, bucket layouts, checks,
zero-copy imports), so an update's data walks forward: link -> receiver -> update session.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from weight_sync.errors import TransportError, TransportTimeout, UpdateStateError
from weight_sync.manifest import Manifest
from weight_sync.transport.config import VERIFY_MODES
from weight_sync.transport.delta_sync import DeltaSession, ReceiverDeltaBase, is_delta_refusal
from weight_sync.transport.disk import DiskReader
from weight_sync.transport.group import Channel, join_store
from weight_sync.transport.liveness import Heartbeat
from weight_sync.transport.receiver_link import ReceiverLink, join_link, open_plane
from weight_sync.transport.status import FOLDED, all_folded, raise_agreed, status_of
from weight_sync.transport.wire import ControlHeader, WireParams

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
        # The connected transport (channel, data plane, buffers, bucket checks), set at connect.
        self._link: ReceiverLink | None = None
        self._store: Any = None
        self._disk: DiskReader | None = None
        self._heartbeat: Heartbeat | None = None
        self._stats_at_start: dict[str, int] = {}
        # Delta sync: a host copy of the last committed update, made once a sender asks for it.
        self._delta_base: ReceiverDeltaBase | None = None
        # A start header that carried its call (``call_in_start``): the call, when this receiver is driven
        # phase by phase (update_weights takes it); receive_update runs it at once (``_whole``).
        self._pending_call: ControlHeader | None = None
        self._whole = False

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
        self._link = join_link(store, params, self.rank, self.device)
        self.buffer_device = self._link.device
        self.shim = self._link.shim
        error = open_plane(self._link, rollback=bool(self.session_options["rollback"]))
        statuses = self._link.channel.exchange_status(status_of(self.rank, "connect", error))
        raise_agreed(statuses, "connect", params.world_size, local=error)
        if self._link.control is not None:
            self._link.channel.use_links({0: self._link.control})  # as the sender does, after the exchange
        # From here on the sender can tell this rank's death (or SIGSTOP) from a slow peer, and name it.
        self._heartbeat = Heartbeat(self.address, self.rank, params.timeout_s)
        self._state = "idle"
        log.info("[rank %d] connected to %s over %s", self.rank, self.address, params.backend)
        return params

    # ------------------------------------------------------------------ control messages
    def _header(self, phase: str, timeout_s: float | None = None) -> ControlHeader:
        """The sender's next header. One that never comes (a dead sender, a broken channel) or makes no
        sense ends the open update here, as a failed phase does: rolled back or torn at once, not left
        open with the calls already written until the next start or close."""
        assert self._channel is not None
        try:
            raw = self._channel.broadcast_bytes(None, phase, timeout_s)
            header = ControlHeader.from_json(raw)
            if header.seq != self._seq + (1 if header.kind == "start" else 0):
                msg = (f"[rank {self.rank}] {phase}: the sender is at update {header.seq}, this receiver at "
                       f"{self._seq}")
                self._channel.fail(msg)
                raise TransportError(msg)
        except BaseException as e:
            self._abort_session(f"{type(e).__name__}: {e}")
            raise
        return header

    def _next_header(self, phase: str) -> ControlHeader:
        """The sender's next phase: the call its start header carried, if not taken yet, else the next
        header on the channel."""
        pending, self._pending_call = self._pending_call, None
        return pending if pending is not None else self._header(phase)

    def _handle(self, header: ControlHeader, wanted: str, error: BaseException | None = None, *,
                fold: bool = False) -> Any:
        """Run the protocol of ``header`` (as a failing rank if it is not what the caller asked for, or
        when ``error`` says this rank already failed). ``fold``: the caller takes the finish too (see
        :meth:`_on_call`)."""
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
                return self._on_call(header, error, fold)
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
        """Whether the compute stream drains within the timeout (always, off CUDA or unconnected)."""
        return True if self._link is None else self._link.drained()

    # ------------------------------------------------------------------ the link's parts, by name
    @property
    def _channel(self) -> Channel | None:
        return None if self._link is None else self._link.channel

    @property
    def _plane(self) -> Any:
        return None if self._link is None else self._link.plane

    @property
    def _buffers(self) -> list[torch.Tensor]:
        return [] if self._link is None else self._link.buffers

    @property
    def _zc(self) -> Any:
        return None if self._link is None else self._link.zc

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
        # The sender set the key as its start began; its header follows once it has prepared the update.
        # The begin's re-check of the model's pointers runs in that wait, off the critical path.
        from weight_sync.reload.api import audit_ahead, forget_audit

        ahead = audit_ahead(self.model)
        try:
            return self._handle(self._header("start_weight_update"), "start")
        finally:
            if ahead:
                forget_audit(self.model)  # used by this start's begin, or by none

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
        self._pending_call = None  # a call of an earlier update never taken: the sender has moved on
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
            manifest = cached.with_version(header.version)
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
                wire = self._delta_base.check(header.delta, manifest.with_version(header.version),
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
        if header.call_in_start:
            # The header is also the call, and the start has no exchange of its own: the call's carries
            # this rank's verdict on the manifest (one receiver: nobody else wrote if it refuses).
            zc = header.zero_copy  # (its releases were applied with the start: not again with the call)
            call = replace(header, kind="call", manifest=None, reuse_manifest_of=None, call_in_start=False,
                           zero_copy=None if zc is None else {**zc, "drop": [], "reset": False})
            if self._whole or error is not None:
                self._on_call(call, error, fold=self._whole)  # a refusal raises the agreed error here
            else:
                self._pending_call = call  # driven phase by phase: update_weights() takes it
            return manifest
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
        return self._handle(self._next_header("update_weights"), "call")

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
            header = self._next_header("update_weights (ended by the engine)")
        except BaseException:
            self._abort_session(reason)  # no sender phase to join (it never came): the local session ends
            raise
        self._handle(header, header.kind, error)

    def _on_call(self, header: ControlHeader, error: BaseException | None, fold: bool = False) -> int:
        """Load one call; with ``fold`` and a call the sender finishes right after (``then_finish``, its
        ``send``), also prepare the commit before the call's status exchange and vote on both in it.

        The exchange then decides the commit exactly as the finish's would: every rank sees every record,
        so when every receiver folded and none failed, all commit after it and the sender sends no finish
        header (one round trip less per update). When some receiver did not fold (an engine driving
        ``update_weights`` and ``finish_weight_update`` itself), the folded ones keep their prepared
        session and take the finish as usual (``prepare`` does not run twice).
        """
        assert self._channel is not None and self._link is not None
        prepared: list[tuple[BaseException | None, dict[str, Any]]] = []

        def prepare_while_loading() -> None:
            # Zero-copy: every load is queued and the device still copies. The commit's checks read host
            # metadata (completeness, the pointer audit) and then wait for the device themselves, so
            # they run now rather than after the link's wait for the loads (which then finds them
            # complete). That device wait has no deadline, and needs none: the loads read the sender's
            # memory only after its event completed, so they depend on nothing outside this process.
            if fold and header.then_finish and error is None and self._incomplete() is None:
                prepared.append(self._prepare_commit())

        loaded, error = self._link.consume_call(header, self._manifest, self._session, self._version, error,
                                                prepare_while_loading if fold and header.then_finish else None)
        # Not with tensors missing: the sender failed mid-call (its status says so; an incomplete
        # verdict here would only blur the agreed error) or it will refuse the finish itself.
        folding = fold and header.then_finish and error is None and (bool(prepared) or self._incomplete() is None)
        phase = "update_weights"
        summary: dict[str, Any] = {}
        if folding:
            error, summary = prepared[0] if prepared else self._prepare_commit()
            if error is not None:
                phase = "finish_weight_update"
            else:
                summary[FOLDED] = True
        statuses = self._channel.exchange_status(status_of(self.rank, phase, error, summary))
        raise_agreed(statuses, "update_weights", self._channel.size, local=error)
        if folding and all_folded(statuses):
            self._commit_prepared()  # receive_update sees this receiver idle and returns last_report
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
        return self._handle(self._next_header("finish_weight_update"), "finish")

    def _on_finish(self, error: BaseException | None) -> Any:
        """Prepare the commit, agree on it in one exchange, then commit (or abort) on every rank alike.

        One round trip, two phases: everything of ``finish`` that can fail (completeness, pending
        processing, hooks, the pointer audit, the fingerprint) runs before the exchange, and only
        bookkeeping that cannot fail runs after it. So no rank commits while another fails, and the
        report travels in the same record as the vote.
        """
        assert self._channel is not None
        summary: dict[str, Any] = {}
        if error is None:
            error = self._incomplete()
        if error is None:
            error, summary = self._prepare_commit()
        statuses = self._channel.exchange_status(status_of(self.rank, "finish_weight_update", error, summary))
        # Any failure, here or elsewhere: _handle aborts this rank's session (a no-op if prepare did).
        raise_agreed(statuses, "finish_weight_update", self._channel.size, local=error)
        return self._commit_prepared()

    def _incomplete(self) -> BaseException | None:
        """The error of committing now with announced tensors missing (None: complete, partial updates
        allowed, or no open update, which :meth:`_prepare_commit` refuses)."""
        if self._session is None or self.session_options["allow_partial"]:
            return None
        missing = self._session.missing()
        if not missing:
            return None
        from weight_sync.errors import IncompleteUpdateError

        return IncompleteUpdateError(
            f"[rank {self.rank}] {len(missing)} announced tensor(s) never arrived: {missing[:5]}", tuple(missing)
        )

    def _prepare_commit(self) -> tuple[BaseException | None, dict[str, Any]]:
        """Everything of the commit that can fail, before the vote, once :meth:`_incomplete` passed: (the
        error, or None and the summary this rank reports in the vote)."""
        session = self._session
        if session is None:
            return UpdateStateError(f"[rank {self.rank}] finish_weight_update without an open update"), {}
        try:
            session.prepare()  # a failure aborts the session (rolled back or torn); a second call returns
        except Exception as e:
            return e, {}
        return None, {"rank": self.rank, **session.prepared_summary(), "transport": self.transport_stats()}

    def _commit_prepared(self) -> Any:
        """After an agreed vote: the bookkeeping that cannot fail."""
        session = self._session
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
        consumer = None if self._link is None else self._link.consumer
        staging = None if consumer is None else consumer.staging
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
        self._whole = True  # a start header carrying the call runs it (and commits, folded) at once
        try:
            try:
                self.start_weight_update(timeout_s)
            except TransportError as e:
                if not is_delta_refusal(e):
                    raise
                log.info("[rank %d] delta refused (%s); receiving the sender's full update", self.rank, e)
                self.start_weight_update(timeout_s)
        finally:
            self._whole = False
        if self._disk is not None:
            self.update_weights()
            return self.finish_weight_update()
        if self._state == "idle":  # the start header carried the call, committed in its exchange
            return self.last_report
        while True:
            header = self._header("update_weights or finish_weight_update")
            if header.kind == "finish":
                return self._handle(header, "finish")
            self._handle(header, "call", fold=True)
            if self._state == "idle":  # committed in the call's exchange (a failure would have raised)
                return self.last_report

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
        if self._link is not None:
            self._link.close()
            self._link = None
        self._store = None
        self._state = "closed"

    def __enter__(self) -> WeightReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
