"""Applying a delta in place on an engine rank: changed values into live storage, quantized layers
requantized only where the changes reach, checksums moved by the changed words alone.

Delta sync's engine side (``weight_sync.transport.delta_sync`` drives it; the wire format is
``weight_sync.transport.delta``). The plan already says where every checkpoint element lands: a
:class:`~weight_sync.reload.plan.CopyOp` copies a (row-strided) slice of the checkpoint tensor into a
contiguous run of a layer tensor. A key whose copies all have that shape gets a *route* of
:class:`~weight_sync.reload.delta_routes.Target` s, one per copy (``weight_sync.reload.delta_routes``):

- ``live``: the destination is a live tensor that is its own model format (a direct layer's tensor, or
  a quantized layer's bias, which processing leaves as loaded): the changed values are scattered into
  it. Nothing is kept: the live bytes *are* the base.
- ``quant``: the destination is the model-format weight of an online-quantized linear (fp8 per-tensor,
  per-channel, block; int8), which the engine no longer holds once quantized. The engine keeps a
  model-format copy of it (recorded during full updates; host memory, pinned when CUDA is there, by
  default), writes the changes into the copy and requantizes only the rows / tiles / elements they reach
  (:func:`weight_sync.quant.delta.apply_quantized_delta_`): bitwise what a full reload quantizes.

Keys without a route (loader calls, column slices of more than one stride, destinations two keys
write, layers processed otherwise, e.g. per expert) take the ordinary session path from a full tensor
rebuilt from a checkpoint-format copy; a processed layer with one such key sends all of its keys that
way, since the session processes a layer only from all of them.

Transactions: every write of an update is undone on abort with rollback (the old values of the written
elements, and host copies of requantized kernel tensors, taken before their first write), otherwise the
written layers are marked torn, as the session does for its own writes.

Checksums: the fingerprint's per-tensor checksum (``weight_sync.checksum``) is two sums of 32-bit words,
so a scattered change moves it by ``(new - old)`` of the words it touches
(``weight_sync.reload.delta_checksum``): a delta update checksums only its changed elements (and fully
only the kernel tensors it requantized). The cached checksums describe
the bytes the last committed update left; like the delta base itself, they assume nothing else writes
the engine's weights between updates (any update that is not a delta drops them).

On a device, a delta's writes go out in grouped launches (``weight_sync.reload.scatter_many``: one per
item size for the live tensors, one for the model-format copies), and the deltas of several buckets
are applied together (:func:`keep_delta_base`'s ``batch_bytes``): a bucket of a dense model holds
hundreds of tensors, and per-tensor launches and per-bucket device syncs, not the device, set the
pace of the apply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from weight_sync import native
from weight_sync.checksum import tensor_checksums
from weight_sync.errors import ConfigError
from weight_sync.layers.tensors import iter_graph_visible_tensors
from weight_sync.quant.delta import apply_quantized_delta_, delta_absmax
from weight_sync.quant.fp8 import Fp8LinearMethod
from weight_sync.quant.int8 import Int8LinearMethod
from weight_sync.quant.online import split_over_group
from weight_sync.reload.delta_base import _INT_OF_SIZE, DeltaApplier, _as_int, _LiveDst, _QuantDst
from weight_sync.reload.delta_checksum import (
    MASK32,
    checksum_change_np,
    checksum_changes,
)
from weight_sync.reload.delta_flat import (
    FlatSnap,
    StagedCall,
    apply_batch,
    by_address_enabled,
    merge_calls,
    stage_call,
)
from weight_sync.reload.delta_routes import Target, key_targets, select
from weight_sync.reload.report import fingerprint
from weight_sync.reload.scatter_many import ScatterWrite, grouped_scatter_available, scatter_many
from weight_sync.reload.state import LayerInfo, ModelState

__all__ = ["DEFAULT_BATCH_BYTES", "DELTA_BASE_ATTR", "DELTA_BATCH_ATTR", "DeltaApplier", "InPlaceUpdate", "keep_delta_base"]

#: Model attribute naming where the engine keeps the model-format copies of quantized weights.
DELTA_BASE_ATTR = "ws_delta_base"
#: Model attribute holding how many bytes of device-resident deltas an engine applies together.
DELTA_BATCH_ATTR = "ws_delta_batch_bytes"
@dataclass(slots=True, eq=False)
class _Fused:
    """A host payload written straight from its 16-bit offsets into one whole live target (its
    encoding is a row of the bucket's :class:`native.OffsetBatch`)."""

    name: str
    payload_bytes: int
    info: LayerInfo
    dst: _LiveDst


#: The default of :func:`keep_delta_base`'s ``batch_bytes``: on the H200 a delta's apply cost ~3 ms of
#: host time and two device syncs per batch whatever its size (an 8B model's 2% delta arrives in 11
#: buckets of 64 MiB). The decode's transients are ~30 bytes per changed element of a batch.
DEFAULT_BATCH_BYTES = 256 << 20


def keep_delta_base(model: nn.Module, where: str = "pinned", *, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
    """Choose where ``model``'s engine keeps the model-format copies delta sync needs for quantized
    layers: ``"pinned"`` (host memory, page-locked when CUDA is there; the default) or ``"device"``
    (the model's device: requantization reads them without a host-to-device copy, at the cost of the
    quantized layers' weights in full precision on the device). Takes effect at the next full update.

    batch_bytes: deltas that arrive on a device are copied out of their buckets and applied together
    once this many bytes of them are queued, or when the update finishes (fewer device syncs and less
    host time per byte; the copies and the decode's transients, ~30 bytes per changed element, are the
    memory it costs). 0 applies every bucket as it arrives."""
    if where not in ("pinned", "device"):
        raise ConfigError(f"delta base must be 'pinned' or 'device', got {where!r}")
    if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 0:
        raise ConfigError(f"delta batch_bytes must be a non-negative int, got {batch_bytes!r}")
    model.__dict__[DELTA_BASE_ATTR] = where
    model.__dict__[DELTA_BATCH_ATTR] = batch_bytes

def _reduces(mod: nn.Module) -> bool:
    """Whether a delta into ``mod``'s quantized weight takes part in a reduction over its TP group even
    when none of its own elements changed (a per-tensor scale shared by the ranks: another rank's change
    moves it; block, channel and int8 scales are each rank's own)."""
    method = getattr(mod, "quant_method", None)
    local = isinstance(method, Fp8LinearMethod) and method.config.granularity != "tensor"
    return not local and not isinstance(method, Int8LinearMethod) and split_over_group(getattr(mod, "tp_group", None))


def _requantize_whole(d: _QuantDst, num_changes: int) -> bool:
    """Whether a weight with ``num_changes`` changed elements is requantized whole (grouped, after the
    bucket) rather than tile by tile / row by row (the threshold: :func:`_whole_from`)."""
    return d.whole_from is not None and num_changes >= d.whole_from


class InPlaceUpdate:
    """One update's in-place writes on one engine rank: what they changed, how to undo them."""

    #: Whether host payloads are batched too (:meth:`stage`; tests set it: CPU runs the batching).
    stage_host = False
    #: Whether staged batches are applied by address off CUDA too (``weight_sync.reload.delta_flat``;
    #: CPU tests set it, under TRITON_INTERPRET=1). On CUDA the environment decides (``BY_ADDRESS_ENV``).
    flat_interpret = False

    @staticmethod
    def reduces(mod: nn.Module) -> bool:
        """:func:`_reduces` (looked up when called: tests replace it)."""
        return _reduces(mod)

    @staticmethod
    def requantize_whole(d: _QuantDst, num_changes: int) -> bool:
        """:func:`_requantize_whole` (looked up when called: tests replace it)."""
        return _requantize_whole(d, num_changes)

    def __init__(self, applier: DeltaApplier, session: Any, mode: str) -> None:
        self.applier = applier
        self.session = session
        self.mode = mode
        # The last update's host positions and old values are not needed any more (its rollback ran or
        # it committed): this one writes over them.
        applier.arena.reset()
        self.state: ModelState = session.state
        self.routes = applier.routes_for(session, mode)
        # A full update's routes, and what they were derived from, for the deltas after it (commit()).
        self._full_routes = (applier.route_key(session), dict(self.routes)) if mode != "delta" else None
        self.touched: set[str] = set()
        self._element_snaps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | FlatSnap] = []
        self._whole_snaps: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._sum_changes: dict[int, list[torch.Tensor]] = {}
        self._dirty: set[int] = set()
        self.recorded: set[tuple[str, str]] = set()
        self.num_in_place = 0
        self.num_requantized = 0
        self.num_whole = 0  # of them: requantized whole after the bucket (flush)
        self.seconds = {"apply": 0.0, "fingerprint": 0.0}  # host time of the in-place writes and the fingerprint
        self.pending_checksums: dict[int, tuple[int, torch.dtype, tuple[int, ...], int]] | None = None
        # item size -> (id of the live tensor, byte positions, old, new) of direct writes on a device,
        # whose checksum moves flush() computes together.
        self._sum_writes: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        # (layer, tensor) -> (method, model-format copy, qweight, scale): written, to requantize whole.
        self._whole: dict[tuple[str, str], tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # Writes of one apply_many call queued for one grouped launch per item size (CUDA with Triton,
        # weight_sync.reload.scatter_many): into live tensors (old values kept, checksums moved) as
        # (write, live tensor, its written region), and into model-format copies (nothing kept).
        self._live_queue: dict[int, list[tuple[ScatterWrite, torch.Tensor, torch.Tensor]]] = {}
        self._copy_queue: dict[int, list[ScatterWrite]] = {}
        # Host writes into live tensors of one write_decoded call, run on native.parallel_map's threads
        # (the scatters run without the GIL): (live tensor, its written region, indices, values, byte
        # offset of the region in the tensor). None outside that call: then they are written at once.
        self._host_queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]] | None = None
        # The grouped launches' checksum moves: per device an int64 [slots, 2] the kernel adds to, and
        # each live tensor's slot (by id); read back once, by the fingerprint.
        self._sum_slots: dict[torch.device, torch.Tensor] = {}
        self._slot_of: dict[int, tuple[torch.device, int]] = {}
        self._slots_used: dict[torch.device, int] = {}
        # Device deltas copied out of their buckets, waiting to be applied together (stage()): by
        # address (delta_flat) where the grouped launch runs, else as views.
        self._staged: list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]] = []
        self._staged_calls: list[StagedCall] = []
        self._by_address = by_address_enabled()
        self._staged_bytes = 0
        self._batch_bytes = int(session.model.__dict__.get(DELTA_BATCH_ATTR, DEFAULT_BATCH_BYTES))

    def _base_device(self) -> torch.device:
        where = self.session.model.__dict__.get(DELTA_BASE_ATTR, "pinned")
        return self.session.device if where == "device" else torch.device("cpu")

    def route(self, name: str) -> tuple[Target, ...] | None:
        if name not in self.routes:  # a key the manifest did not list (the session refuses it)
            self.routes[name] = key_targets(self.state, self.session.plan, name)
        return self.routes[name]

    def record(self, name: str, tensor: torch.Tensor, targets: tuple[Target, ...]) -> None:
        """A full update's tensor: copy its slices into the model-format copies of quantized weights."""
        src = tensor.contiguous().reshape(-1)
        for t in targets:
            if t.kind != "quant":
                continue
            base = self.applier.model_format_copy(self.state.layers[t.layer], t.tensor, self._base_device())
            dst = base.view(-1)[t.dst_offset : t.dst_offset + t.numel]
            part = src if t.whole else src.as_strided((t.rows, t.cols), (t.src_row_stride, 1),
                                                      src.storage_offset() + t.src_offset)
            dst.view(t.rows, t.cols).copy_(part.reshape(t.rows, t.cols))
            self.applier.absmax.pop((t.layer, t.tensor), None)  # of the old copy: made again at the next delta
            self.recorded.add((t.layer, t.tensor))

    def stage(self, items: list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]]) -> None:
        """Queue one call's in-place deltas for :meth:`apply_many` with the next ones (``batch_bytes`` of
        :func:`keep_delta_base`); host payloads are applied at once (their decode has no launches or
        device syncs to share). The payloads are copied out of the caller's bucket in one launch on
        the current stream (the transport reuses the bucket once this call's work is done). A queued key
        counts as arrived (the session's completeness check runs before the finish applies the rest)."""
        if not items:
            return
        device = items[0][1].device
        if (device.type == "cpu" and not self.stage_host) or self._batch_bytes <= 0:
            self.apply_many(items)
            return
        flat = self.flat_interpret or (self._by_address and grouped_scatter_available(device))
        call = stage_call(items) if flat else None
        if call is not None:
            for name, payload, _, _, _ in items:
                self.session.mark_applied(name, payload.numel())
            self._staged_calls.append(call)
            self._staged_bytes += call.buf.numel()
            if self._staged_bytes >= self._batch_bytes:
                self.apply_staged()
            return
        # Encodings are 8-byte multiples: every copy keeps the alignment its decode reads in place.
        copies = torch.cat([payload for _, payload, _, _, _ in items]) if len(items) > 1 else items[0][1].clone()
        at = 0
        for name, payload, numel, dtype, targets in items:
            n = payload.numel()
            self._staged.append((name, copies[at : at + n], numel, dtype, targets))
            self.session.mark_applied(name, n)
            at += n
        self._staged_bytes += at
        if self._staged_bytes >= self._batch_bytes:
            self.apply_staged()

    def apply_staged(self) -> None:
        """Apply the queued deltas (:meth:`stage`); called when the batch is full and before the finish."""
        items, self._staged, self._staged_bytes = self._staged, [], 0
        calls, self._staged_calls = self._staged_calls, []
        if calls:
            apply_batch(self, merge_calls(calls))
        if items:
            self.apply_many(items, marked=True)

    def apply_many(self, items: list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]],
                   marked: bool = False) -> None:
        """Decode the deltas of several tensors (one bucket), check them all, then write them in place.

        On CUDA the payloads are decoded together (:func:`~weight_sync.transport.delta_batch.decode_deltas`:
        one read of their headers, one set of launches, one read of every check), and the block- and
        channel-scaled weights the changes reach densely are requantized whole at the end, in one
        grouped launch (:meth:`flush`). Nothing is written before every payload of ``items`` has passed
        its checks.
        """
        # Imported here: weight_sync.transport imports this module (through delta_sync).
        from weight_sync.transport.delta_batch import decode_deltas

        if not items:
            return
        t0 = time.perf_counter()
        fused, batch, items, parsed = self._split_fused(items)
        # Every payload checked (the fused ones, in one call) or decoded and checked whole before the first
        # write (on a device: together).
        batch.check()
        decoded = decode_deltas([(payload, numel, dtype) for _, payload, numel, dtype, _ in items], self.applier.arena,
                                parsed)
        self._write_fused(fused, batch, marked)
        self.write_decoded(items, decoded, marked)
        self._write_queued()  # before flush(): the whole requantization reads the written copies
        self.flush()
        self.seconds["apply"] += time.perf_counter() - t0

    def _split_fused(self, items: list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]]
                     ) -> tuple[list[_Fused], native.OffsetBatch,
                                list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]], list[Any] | None]:
        """The host payloads written straight from their offsets (no positions made) with their
        encodings as one batch, the rest, and the rest's parses (None where nothing was parsed here).
        Fused: index chunks only with 16-bit offsets, one whole live target of the wire's dtype, no
        rollback (which keeps the positions and old values); the rest decode."""
        batch = native.OffsetBatch()
        if self.session.rollback or not native.enabled() or not items or items[0][1].device.type != "cpu":
            return [], batch, items, None
        from weight_sync.transport.delta_batch import head_tables, parse_many
        from weight_sync.transport.delta_format import FORM_INDEX, FORM_SAME

        wire = [(payload, numel, dtype) for _, payload, numel, dtype, _ in items]
        heads, tab = head_tables(wire)
        # Index-only tables (every chunk unchanged with no count, or index with a count >= 0) with 16-bit
        # offsets: the batch reads their counts in place, one per chunk, so each table is checked here.
        ok = tab.usable & (tab.n_plain_chunks == 0) & (tab.n_bits == 0) & (tab.chunk_elems <= 1 << 16)
        owner = np.repeat(np.arange(len(items)), np.diff(tab.chunk_at))
        sound = ((tab.form == FORM_INDEX) & (tab.counts >= 0)) | ((tab.form == FORM_SAME) & (tab.counts == 0))
        ok &= np.bincount(owner[~sound], minlength=len(items)) == 0
        fused: list[_Fused] = []
        take, dst, numel, base, payload_at = [], [], [], [], []
        for i in np.flatnonzero(ok).tolist():
            name, payload, _, dtype, targets = items[i]
            job = self._fused_target(name, payload, dtype, targets)
            if job is None:
                continue
            take.append(i)
            dst.append(job.dst.region.data_ptr())
            numel.append(job.dst.region.numel())
            base.append(targets[0].dst_offset * job.dst.size)
            payload_at.append(payload.data_ptr())
            fused.append(job)
        if take:
            at = np.asarray(take, dtype=np.int64)
            region = tab.region_at[at]
            start = np.asarray(payload_at, dtype=np.int64)
            batch.add_table([items[i][0] for i in take], np.asarray(dst, dtype=np.int64),
                            np.asarray(numel, dtype=np.int64), tab.counts, tab.chunk_at[at], tab.num_chunks[at],
                            tab.chunk_elems[at], start + region[:, 1], start + region[:, 2],
                            np.array([items[i][3].itemsize for i in take], dtype=np.int64),
                            np.asarray(base, dtype=np.int64), [items[i][1] for i in take])
        taken = set(take)
        others = [i for i in range(len(items)) if i not in taken]
        rest, rest_parsed = [], []
        for i, p in zip(others, parse_many(wire, (heads, tab), others) if others else []):
            # Parsed alone (a table beyond the leading bytes read together: another chunk size), or not
            # index-only: fused one by one where they qualify, else decoded.
            name, payload, _, dtype, targets = items[i]
            index_only = not p.n_bits and not p.n_plain_chunks and p.chunk_elems <= 1 << 16
            job = None if tab.usable[i] or not index_only else self._fused_target(name, payload, dtype, targets)
            if job is None:
                rest.append(items[i])
                rest_parsed.append(p)
                continue
            chunks = np.flatnonzero(p.form == FORM_INDEX)
            batch.add(name, job.dst.region, chunks, p.counts[chunks], p.regions[1].numpy().view(np.int16),
                      p.chunk_elems, p.regions[2], targets[0].dst_offset * job.dst.size)
            fused.append(job)
        return fused, batch, rest, rest_parsed

    def _fused_target(self, name: str, payload: torch.Tensor, dtype: torch.dtype,
                      targets: tuple[Target, ...]) -> _Fused | None:
        """``name``'s fused write when its one target is a whole live host tensor of the wire's dtype (its
        encoding then goes into the offsets batch), else None."""
        if len(targets) != 1 or targets[0].kind != "live" or not targets[0].whole:
            return None
        t = targets[0]
        info = self.state.layers[t.layer]
        d = self.applier.live_dst(info, t)
        if d.device.type != "cpu" or d.dtype != dtype:
            return None
        return _Fused(name, payload.numel(), info, d)

    def _write_fused(self, fused: list[_Fused], batch: native.OffsetBatch, marked: bool) -> None:
        """The fused host payloads written (on several threads when large), their checksum moves kept; a
        failure is raised after every other write is recorded (the session is torn: no rollback here)."""
        if not fused:
            return
        for job in fused:
            self.touched.add(job.info.name)  # before any write: a failure leaves the layer torn
        failed: Exception | None = None
        for job, moved in zip(fused, batch.scatter()):
            if isinstance(moved, Exception):
                failed = failed or moved
                continue
            self._sum_changes.setdefault(id(job.dst.live), []).append(moved)
            if not marked:
                self.session.mark_applied(job.name, job.payload_bytes)
            self.num_in_place += 1
        if failed is not None:
            raise failed

    def write_decoded(self, items: list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]],
                      decoded: list[tuple[torch.Tensor, torch.Tensor]], marked: bool) -> None:
        """Write (or queue, for the grouped launches) the decoded changes of ``items`` into their targets."""
        if not items:
            return
        grouped = grouped_scatter_available(items[0][1].device)
        # Host scatters wait for the end of the loop and run on several threads (a failure before then
        # drops them unwritten: nothing of theirs to roll back).
        self._host_queue = [] if native.enabled() else None
        try:
            for (name, payload, _, dtype, targets), (pos, vals) in zip(items, decoded):
                for t in targets:
                    info = self.state.layers[t.layer]
                    idx, v = select(t, pos, vals)
                    if t.kind == "live":
                        self._scatter(info, t, idx, v, dtype, grouped)
                    else:
                        self._requantize(info, t, idx, v, dtype, grouped)
                if not marked:
                    self.session.mark_applied(name, payload.numel())  # applied here, not through load()
                self.num_in_place += 1
            queue = self._host_queue
        finally:
            self._host_queue = None
        if queue:
            self._write_host_queue(queue)

    def _write_host_queue(self, queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]]
                          ) -> None:
        """The queued host scatters, on several threads; each one's old values and checksum move are
        recorded (in queue order) before the first failure, if any, is raised: a scatter that fails
        writes nothing, and every one that wrote can be rolled back."""
        def run(job: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
            _, region, idx, v, byte_base = job
            return native.scatter_tensors(region, idx, v, byte_base, arena)

        arena = self.applier.arena
        failed: Exception | None = None
        # A change touches a 64-byte line of its destination at most (the work's upper estimate).
        lines = sum(64 * job[2].numel() for job in queue)
        for (live, region, idx, _, _), done in zip(queue, native.parallel_settle(run, queue, lines)):
            if isinstance(done, Exception):
                failed = failed or done
                continue
            old, moved = done
            self._sum_changes.setdefault(id(live), []).append(moved)
            if self.session.rollback:
                self._element_snaps.append((region, idx, old))
        if failed is not None:
            raise failed

    def flush(self) -> None:
        """Requantize the weights whose changes were only written into their model-format copies (see
        :meth:`_requantize`): whole, from the copy, grouped per quantization method; and move the
        checksums of the bucket's direct writes on a device, all of one item size together."""
        for size, writes in self._sum_writes.items():
            rows = checksum_changes([w[1:] for w in writes], size)
            for (tid, *_), row in zip(writes, rows):
                self._sum_changes.setdefault(tid, []).append(row)
        self._sum_writes.clear()
        if not self._whole:
            return
        # Grouped by configuration, not by method object: every layer has its own method instance, and
        # quantize_bands depends only on the configuration (one grouped launch per kernel shape).
        by_method: dict[Any, tuple[Any, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]] = {}
        for key, (method, base, q, s) in self._whole.items():
            by_method.setdefault((type(method), method.config), (method, []))[1].append((base, q, s))
            # Whatever absmax state a tile write of this weight kept, the new scales supersede it (made
            # again from them when next needed).
            self.applier.absmax.pop(key, None)
        self._whole.clear()
        for method, group in by_method.values():
            method.quantize_bands(group)

    def _write_queued(self) -> None:
        """The queued writes of this call, one grouped launch per item size and kind (a launch that
        cannot take them writes them one by one, as without the queue)."""
        for size, writes in self._copy_queue.items():
            if not scatter_many(writes, size):
                for w in writes:
                    w.dst.view(-1)[w.pos + w.offset if w.offset else w.pos] = w.vals
        self._copy_queue.clear()
        for size, group in self._live_queue.items():
            writes = [w for w, _, _ in group]
            dev = writes[0].dst.device
            old = torch.empty(sum(w.pos.numel() for w in writes), dtype=_INT_OF_SIZE[size], device=dev)
            slots = [self._slot(live) for _, live, _ in group]
            if scatter_many(writes, size, old=old, sums=self._sum_slots[dev], slots=slots):
                if self.session.rollback:
                    at = 0
                    for w, _, region in group:
                        n = w.pos.numel()
                        self._element_snaps.append((region, w.pos, old[at : at + n]))
                        at += n
                continue
            for w, live, region in group:
                self._write_live(live, region, w.pos, w.vals, w.offset)
        self._live_queue.clear()

    def _slot(self, live: torch.Tensor) -> int:
        """``live``'s row in its device's checksum slots (made, or grown, when new)."""
        got = self._slot_of.get(id(live))
        if got is not None:
            return got[1]
        dev = live.device
        slot = self._slots_used.get(dev, 0)
        self._slots_used[dev] = slot + 1
        self._slot_of[id(live)] = (dev, slot)
        sums = self._sum_slots.get(dev)
        if sums is None or sums.shape[0] <= slot:
            grown = torch.zeros(max(64, 2 * slot), 2, dtype=torch.int64, device=dev)
            if sums is not None:
                grown[: sums.shape[0]] = sums
            self._sum_slots[dev] = grown
        return slot

    def _write_live(self, live: torch.Tensor, region: torch.Tensor, idx: torch.Tensor, v: torch.Tensor,
                    offset: int) -> None:
        """One write into a live tensor on a device (torch indexing); its checksum move is computed with
        the bucket's other such writes of its item size (flush)."""
        size = live.element_size()
        old = region[idx]
        region[idx] = v
        self._sum_writes.setdefault(size, []).append((id(live), (idx + offset) * size, old, v))
        if self.session.rollback:
            self._element_snaps.append((region, idx, old))

    def _scatter(self, info: LayerInfo, t: Target, idx: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                 grouped: bool = False) -> None:
        if not idx.numel():
            return  # nothing of this key changed here
        d = self.applier.live_dst(info, t)
        live, region = d.live, d.region
        idx = idx.to(d.device)
        if d.dtype != dtype:
            # The session's copy converts (a bf16 wire into an fp32 norm): so does this, element by
            # element, which is what the whole copy does to the changed elements.
            v = _as_int(v.view(dtype).to(d.device).to(d.dtype))
        else:
            v = v.to(d.device)
        self.touched.add(info.name)
        size = d.size
        if d.device.type == "cpu":
            # numpy (or one native pass: gather, write and checksum move together): a fraction of torch's
            # per-call overhead, and this runs for every tensor of a delta.
            if self._host_queue is not None:
                self._host_queue.append((live, region, idx, v, t.dst_offset * size))
                return
            if native.enabled():
                old, moved = native.scatter_tensors(region, idx, v, t.dst_offset * size)
            else:
                r, i, new = region.numpy(), idx.numpy(), v.numpy()
                old_np = r[i]
                r[i] = new
                old = torch.from_numpy(old_np)
                moved = torch.from_numpy(checksum_change_np((i + t.dst_offset) * size, old_np, new, size))
            self._sum_changes.setdefault(id(live), []).append(moved)
            if self.session.rollback:
                self._element_snaps.append((region, idx, old))
        elif grouped:
            # Written with the call's other live writes of this item size (_write_queued).
            self._live_queue.setdefault(size, []).append((ScatterWrite(d.flat, t.dst_offset, idx, v), live, region))
        else:
            self._write_live(live, region, idx, v, t.dst_offset)

    def _requantize(self, info: LayerInfo, t: Target, idx: torch.Tensor, v: torch.Tensor, dtype: torch.dtype,
                    grouped: bool = False) -> None:
        mod = info.module
        d = self.applier.quant_dst(info, t)
        n = idx.numel()
        if not n and not _reduces(mod):
            return  # nothing of this key changed, and no peer waits on a scale reduction of it
        self.begin_requantize(info, d)
        base = d.base
        key = (info.name, t.tensor)
        if key in self._whole or _requantize_whole(d, n):
            # Dense changes on the device: write them into the copy now and requantize it whole in
            # flush(), grouped with the other such weights of the bucket. Bitwise what the tile path
            # gives (both equal quantize(copy)), at a fraction of its launches and without its sync.
            # Once a weight waits here, later keys of it (q, k, v of one fused qkv) wait too: the tile
            # path's absmax state describes the copy as its scales do, which the written changes left.
            if grouped and d.base_dtype == dtype and d.base_device == v.device and idx.device == v.device:
                # Written with the call's other such writes before flush() (_write_queued).
                self._copy_queue.setdefault(base.element_size(), []).append(
                    ScatterWrite(d.base_int, t.dst_offset, idx, v))
            else:
                at = idx + t.dst_offset if t.dst_offset else idx
                base.view(-1)[at.to(base.device)] = v.view(dtype).to(base.device, base.dtype)
            self.mark_whole(info, t, d)
            return
        absmax = self.applier.absmax.get(key)
        if absmax is None:
            # The first delta since the copy was recorded: block scales give it without a read of the
            # copy (a 2-byte base), a per-tensor scale from one read; later deltas keep it current.
            absmax = delta_absmax(d.method, base, d.s)
            if absmax is not None:
                self.applier.absmax[key] = absmax
        at = idx + t.dst_offset if t.dst_offset else idx
        apply_quantized_delta_(d.method, base, at, v.view(dtype).to(base.dtype), d.q, d.s,
                               getattr(mod, "tp_group", None), absmax=absmax)
        self.num_requantized += 1

    def begin_requantize(self, info: LayerInfo, d: _QuantDst) -> None:
        """Before a quantized weight's first write of this update: its kernel tensors' snapshot (rollback),
        its layer touched, its checksums to compute afresh."""
        if self.session.rollback and info.name not in self._whole_snaps:
            self._whole_snaps[info.name] = [(x, x.detach().to("cpu", copy=True)) for x in (d.q_param, d.s_param)]
        self.touched.add(info.name)
        self._dirty.update((id(d.q_param), id(d.s_param)))

    def mark_whole(self, info: LayerInfo, t: Target, d: _QuantDst) -> None:
        """``t``'s weight, its changes written into its model-format copy, is requantized whole in flush()."""
        self._whole[(info.name, t.tensor)] = (d.method, d.base, d.q, d.s)  # flush() drops its absmax state
        self.num_requantized += 1
        self.num_whole += 1

    def fingerprint(self, model: nn.Module) -> str:
        """The model's fingerprint after this update, from cached checksums moved by the changes where
        they are known; the checksums become the cache's on :meth:`commit`."""
        t0 = time.perf_counter()
        cache = self.applier.checksums if self.mode == "delta" else {}
        named = [(n, t) for n, t in iter_graph_visible_tensors(model) if t.device.type != "meta"]
        items = [t for _, t in named]
        known: dict[int, int] = {}
        moved: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        todo = []
        # The grouped launches' moves (scatter_many's slots): one read-back per device.
        slot_rows: dict[int, list[int]] = {}
        if self._slot_of:
            rows = {dev: sums.tolist() for dev, sums in self._sum_slots.items()}
            slot_rows = {tid: rows[dev][slot] for tid, (dev, slot) in self._slot_of.items()}
        # Each tensor's (address, dtype, shape) once: compared with the cache here, kept with its checksum below.
        sigs = [(t.data_ptr(), t.dtype, tuple(t.shape)) for t in items]
        for t, sig in zip(items, sigs):
            c = cache.get(id(t))
            if c is None or id(t) in self._dirty or c[:3] != sig:
                todo.append(t)
            elif id(t) in self._sum_changes or id(t) in slot_rows:
                listed = self._sum_changes.get(id(t))
                moved.append((t, c[3], torch.stack(listed).sum(0) if listed else None))
            else:
                known[id(t)] = c[3]
        if moved:
            # One read-back per update and device (each .to("cpu") of its own would be a device sync).
            sums = [[0, 0]] * len(moved)
            for dev in {m[2].device for m in moved if m[2] is not None}:
                at = [i for i, m in enumerate(moved) if m[2] is not None and m[2].device == dev]
                for i, pair in zip(at, torch.stack([moved[i][2] for i in at]).tolist()):  # type: ignore[misc]
                    sums[i] = pair
            for i, (t, _, _) in enumerate(moved):
                extra = slot_rows.get(id(t))
                if extra is not None:
                    sums[i] = [sums[i][0] + extra[0], sums[i][1] + extra[1]]
            for (t, value, _), (d_plain, d_weighted) in zip(moved, sums):
                nbytes = t.numel() * t.element_size()
                halves = value ^ nbytes
                hi = ((halves >> 32) + d_plain) & MASK32
                lo = ((halves & MASK32) + d_weighted) & MASK32
                known[id(t)] = ((hi << 32) | lo) ^ nbytes
        known.update(zip(map(id, todo), tensor_checksums(todo)))
        self.pending_checksums = {id(t): (*sig, known[id(t)]) for t, sig in zip(items, sigs)}
        out = fingerprint(model, known, named)
        self.seconds["fingerprint"] += time.perf_counter() - t0
        return out

    def commit(self) -> None:
        if self.pending_checksums is not None:
            self.applier.checksums = self.pending_checksums
        if self.mode == "full":
            self.applier.keep_only(self.recorded)
        if self._full_routes is not None:
            self.applier.keep_routes(*self._full_routes, self.session)

    def undo(self, reason: str) -> None:
        """Undo this update's in-place writes (rollback) or mark their layers torn; drop the caches."""
        self.applier.checksums = {}
        self.applier.absmax = {}  # they moved with the model-format copies, which the undo leaves written
        self._staged, self._staged_calls, self._staged_bytes = [], [], 0  # never applied: nothing to undo
        if not self.touched:
            return
        if self.session.rollback:
            with torch.no_grad():
                for snap in reversed(self._element_snaps):
                    if isinstance(snap, FlatSnap):
                        snap.restore()
                    else:
                        region, idx, old = snap
                        region[idx] = old
                for snaps in self._whole_snaps.values():
                    for live, host in snaps:
                        live.detach().copy_(host)
        else:
            self.state.tear(self.touched, reason)
        self._element_snaps.clear()
        self._whole_snaps.clear()
