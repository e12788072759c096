"""UpdateSession: one weight update as a transaction over a live model.

Life of a session: ``begin_update`` validates the manifest against the plan (before any write) and snapshots
pointer signatures; ``load`` takes (name, tensor) pairs in any order; ``finish`` checks completeness, runs
post-update hooks, verifies that no graph-visible tensor moved, and returns an :class:`UpdateReport`.

Two paths per layer. *Direct* layers (kernel format == model format) get their slices copied straight into
live storage. *Processed* layers (online quantization, repacking) get zero-filled model-format staging
tensors when their first key arrives (or borrow the caller's memory where it already is that staging,
see :mod:`weight_sync.reload.borrow`); when their last expected key arrives they are processed and the
resulting kernel tensors are copied into the kernel tensors that existed before, whose objects (and
addresses) are then reinstalled; a layer of units (experts) does so per unit on reloads (:mod:`.units`).
Staging on the model's device is capped by the budget; beyond it staging goes to host memory.

Failure at any point aborts: with ``rollback=True`` every layer written so far is restored bitwise from a
host snapshot taken just before its first write; otherwise the model is marked torn and refuses to serve
until a full update succeeds. It never silently serves a mix of versions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from weight_sync.errors import (
    DuplicateTensorError,
    LayoutMismatchError,
    ManifestError,
    UpdateStateError,
)
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.quant.online import RowBands
from weight_sync.reload.audit import check_layers_recorded, still_holds, take_baseline
from weight_sync.reload.bands import band_target, layer_bands
from weight_sync.reload.borrow import lend_batch, lend_single, lenders
from weight_sync.reload.ending import EndingSteps
from weight_sync.reload.plan import CopyOp, KeyPlan, Plan, dst_view
from weight_sync.reload.processing import Lend, OpenLayer, storage_uses
from weight_sync.reload.replay import list_names, record_list, replay_list
from weight_sync.reload.report import UpdateReport
from weight_sync.reload.state import LayerInfo, ModelState, model_load_weights
from weight_sync.reload.validation import (
    accept_manifest,
    check_against_plan,
    fmt_layout,
    plan_missing,
)
from weight_sync.reload.writes import WriteQueue

__all__ = ["UpdateSession"]

log = logging.getLogger(__name__)


class UpdateSession(EndingSteps):
    """A weight update in progress on one model; create it with :func:`weight_sync.begin_update`."""

    def __init__(
        self,
        model: nn.Module,
        state: ModelState,
        *,
        manifest: Manifest | None = None,
        budget_bytes: int | None = None,
        rollback: bool = False,
        version: Any = None,
        allow_partial: bool = False,
        compute_fingerprint: bool = True,
    ) -> None:
        if state.active is not None:
            raise UpdateStateError(
                f"an update (version {state.active.version!r}) is already in progress on this model; "
                "finish or abort it first"
            )
        t0 = time.perf_counter()
        self.model = model
        self.state = state
        self.manifest = manifest
        self.rollback = rollback
        self.version = version if version is not None else (manifest.version if manifest else None)
        self.allow_partial = allow_partial
        self.compute_fingerprint = compute_fingerprint
        self.device = _model_device(model)
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = state.largest_block_bytes() if budget_bytes is None else budget_bytes
        if state.plan is None:
            state.plan = Plan()
        self.plan: Plan = state.plan
        self._status = "open"
        self._prepared: tuple[list[str], str | None] | None = None  # (missing, fingerprint) once prepared
        self.report: UpdateReport | None = None  # set by finish()
        self._arrived: set[str] = set()
        # Keys counted as arrived by mark_applied that the manifest did not announce (see EndingSteps.
        # _all_expected_arrived: while none, arrivals are a subset of the expected names).
        self._unannounced_applied = 0
        self._open: dict[str, OpenLayer] = {}
        self._touched: set[str] = set()
        self._snapshots: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Staging buffers of completed layers by (shape, stride, dtype, device, pinned): the next layer of
        # the same layout reuses one that nothing else references any more, instead of faulting in
        # fresh pages.
        self._staging_pool: dict[tuple, list[torch.Tensor]] = {}
        # (module, initial attribute names, processor-created attributes before this update), for rollback.
        self._attr_snapshots: list[tuple[nn.Module, frozenset[str], dict[str, Any]]] = []
        self._processed_done: list[str] = []
        self._first_processed: list[LayerInfo] = []
        self._init_units()
        # Layers quantized band by band this update (reload/bands.py), and the verdict for each layer asked.
        self._banded: dict[str, dict[str, RowBands]] = {}
        self._band_layers: dict[str, dict[str, RowBands] | None] = {}
        if state.write_queue is None:
            state.write_queue = WriteQueue()
        self._writes: WriteQueue = state.write_queue
        self._writes.drop()  # nothing of an earlier update may be left (it would have been flushed)
        self._writes.carrier, self._writes.release = self._carry_band, self._release
        self._writes.written = self._matrix_written
        self._buffered = 0
        self._peak = 0
        self._host_held = 0
        self._host_peak = 0
        self._held_peak = 0
        self._spilled = 0
        self._waited: set[str] = set()
        self._on_close: list[Callable[[], None]] = []
        self.route: Callable[[str, str, torch.Tensor], Any] | None = None
        self._loading = 0  # load() calls in progress (a loader reached from one is the session's own)
        self._num_bytes = 0
        self._replayed = 0
        self._via_loader = 0
        self._ignored: list[str] = []
        self._seconds = {"plan": 0.0, "load": 0.0, "process": 0.0, "copy_back": 0.0}
        self._t0 = t0
        self._keep_baseline = False
        self._host = torch.device("cpu")
        # Layers that may borrow (computed at the first list or tuple passed to load), and the borrowing
        # decided for the current load call, by layer.
        self._lenders: set[str] = set()
        self._lenders_known = False
        self._lend: dict[str, Lend] = {}
        self.expected: frozenset[str] | None
        self._announced: dict[str, tuple[torch.Size, torch.dtype]] | None
        if manifest is not None:
            self.expected, self._announced = accept_manifest(self.model, self.state, self.plan, manifest,
                                                              self.allow_partial)
        else:
            self.expected = frozenset(state.reference.names) if state.reference is not None else None
            self._announced = None
        # The audit's baseline: the last committed update's when it still holds (an indexed re-check),
        # else one walk of the model; finish re-checks it by index.
        kept, ahead = state.last_baseline, state.audited_ahead
        state.last_baseline = state.audited_ahead = None  # owned by this session now; a commit hands one back
        if kept is not None and (ahead is kept or still_holds(kept, model)):
            self._baseline = kept
        else:
            self._baseline = take_baseline(model)
            check_layers_recorded(state.layers, self._baseline)
        self._before = self._baseline.signatures
        if state.last_signatures != self._before:
            state.forget_views()  # something moved since the last update: cached views may be stale
        self._views = state.views
        self._seconds["plan"] = time.perf_counter() - t0
        state.active = self

    def layer_order(self, names: Iterable[str]) -> list[str]:
        """``names`` sorted so every layer's keys come together, layers in model order (stable).

        Keys the plan does not know keep their relative place at the end.
        """
        rank = {name: i for i, name in enumerate(self.state.layers)}
        end = len(rank)

        def key(n: str) -> int:
            kp = self.plan.keys.get(n)
            return min((rank[layer] for layer in kp.layers), default=end) if kp else end

        return sorted(names, key=key)

    # ------------------------------------------------------------------ loading
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs; the tensors may be reused by the caller once this returns."""
        self._require_open()
        # Parameters may require grad (a trainer-side model); writes into them are not autograd ops.
        # Grad mode is switched directly: this runs once per tensor and torch.no_grad() objects cost
        # more than the bookkeeping of a small tensor.
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        self._loading += 1
        try:
            t0 = time.perf_counter()
            # A list or tuple can be looked at as a whole before loading (a generator is not
            # materialized: it could hold a whole model): find layers it can lend its memory to.
            listed = type(named_tensors) in (list, tuple)
            self._writes.carry_now = not listed
            names = list_names(named_tensors) if listed else ()  # type: ignore[arg-type]
            done = replay_list(self, named_tensors, names) if names else 0  # type: ignore[arg-type]
            if done:
                # A list recorded at an earlier update (direct and band-quantized layers): written in pieces.
                if done == len(names):
                    self._seconds["load"] += time.perf_counter() - t0
                    return
                # A piece failed its check: the per-key path loads the rest (and names what is wrong),
                # without recording the remainder as a list of its own.
                named_tensors, names = named_tensors[done:], ()  # type: ignore[index]
            if listed:
                if not self._lenders_known:
                    # Banded layers need no staging at all, borrowed or not.
                    self._lenders = {n for n in lenders(self) if self._bands_of(self.state.layers[n]) is None}
                    self._lenders_known = True
                if self._lenders:
                    self._lend = lend_batch(self, named_tensors)  # type: ignore[arg-type]
            for name, tensor in named_tensors:
                self._load_one(name, tensor)
            self._writes.flush()  # before returning: the caller may reuse its tensors
            if names:
                record_list(self, named_tensors, names)  # type: ignore[arg-type]
            if self._writes.matrices:
                # One-scale matrices whose keys straddle this call and the next keep copies of their
                # bands: that matrix's staging (see _carry_band).
                self._writes.carry()
            self._seconds["load"] += time.perf_counter() - t0
        except BaseException as e:
            self._writes.drop()
            self._fail(e)
            raise
        finally:
            self._loading -= 1
            if self._lend:
                self._lend = {}
            torch._C._set_grad_enabled(grad)

    def _key_plan(self, name: str, tensor: torch.Tensor) -> KeyPlan:
        kp = self.plan.keys.get(name)
        if kp is None:
            t0 = time.perf_counter()
            problems = plan_missing(self.model, self.state, self.plan, [TensorMeta(name, tensor.dtype, tuple(tensor.shape))])
            self._seconds["plan"] += time.perf_counter() - t0
            if name in problems:
                raise problems[name]
            kp = self.plan.keys[name]
        return kp

    def _load_one(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._arrived:
            raise DuplicateTensorError(f"{name}: arrived twice in update {self.version!r}")
        if not isinstance(tensor, torch.Tensor):
            raise LayoutMismatchError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        shape = tensor.shape  # read once: each read builds a torch.Size (this runs for every name)
        if self._announced is not None:
            announced = self._announced.get(name)
            if announced is None or shape != announced[0] or tensor.dtype is not announced[1]:
                self._check_announced(name, tensor)
        fast = self._views.get(name)
        if fast is not None:
            # Hot path: a planned key into direct layers, destinations precomputed as views of live
            # storage (valid while pointers are unchanged, which every update verifies).
            kp, views = fast
            if shape != kp.shape or (kp.floating and tensor.dtype not in _FLOATS):
                raise LayoutMismatchError(check_against_plan(kp, tuple(shape), tensor.dtype))
            self._arrived.add(name)
            self._num_bytes += tensor.nbytes
            touched = self._touched
            for layer in kp.layers:
                if layer not in touched:
                    self._prepare(layer)
            for write, op in views:
                write(tensor if op.src_whole else _src_view(op, tensor))
            self._replayed += 1
            return
        kp = self.plan.keys.get(name) or self._key_plan(name, tensor)
        if tensor.shape != kp.shape or (kp.floating and tensor.dtype not in _FLOATS):
            msg = check_against_plan(kp, tuple(tensor.shape), tensor.dtype)
            if msg:
                raise LayoutMismatchError(msg)
        self._arrived.add(name)
        self._num_bytes += tensor.nbytes
        self._load_general(name, tensor, kp)

    def _check_announced(self, name: str, tensor: torch.Tensor) -> None:
        assert self.manifest is not None
        if name not in self.manifest:
            raise ManifestError(f"{name}: was not announced in the manifest of update {self.version!r}")
        m = self.manifest[name]
        if tuple(tensor.shape) != m.shape or tensor.dtype != m.dtype:
            raise ManifestError(
                f"{name}: manifest announced {fmt_layout(m.shape, m.dtype)}, "
                f"got {fmt_layout(tuple(tensor.shape), tensor.dtype)}"
            )

    def _load_general(self, name: str, tensor: torch.Tensor, kp: KeyPlan) -> None:
        if kp.mode == "ignored":
            self._ignored.append(name)
            return
        if (len(kp.ops) == 1 and kp.ops[0].layer not in self._lend
                and self._bands_of(self.state.layers[kp.ops[0].layer]) is None):
            single = lend_single(self, name, tensor, kp)
            if single is not None:
                self._lend[kp.ops[0].layer] = single
        for layer in kp.layers:
            self._prepare(layer)
        if kp.mode == "copy":
            views, direct = self._replay(kp, tensor)
            if direct:
                self._views[name] = (kp, views)
            self._replayed += 1
        else:
            model_load_weights(self.model)([(name, tensor)])
            self._via_loader += 1
        self._key_written(name, kp)

    def _key_written(self, name: str, kp: KeyPlan) -> None:
        """Every byte of key ``name`` is written: complete the layers (or units) it was the last key of."""
        for layer in kp.layers:
            ol = self._open.get(layer)
            if ol is not None:
                ol.remaining.discard(name)
                if not ol.remaining and self.expected is not None:
                    self._complete(ol)
                    if ol.lent:
                        self._check_lent(ol)
            elif self._unit_open:
                self._unit_arrived(layer, name)

    def _replay(self, kp: KeyPlan, tensor: torch.Tensor, layer: str | None = None) -> tuple[list, bool]:
        """Replay the key's copies (only those into ``layer`` if given), skipping borrowed staging (the
        caller's tensor already is it); returns (destination views, whether they may be cached)."""
        src = tensor
        if not src.is_contiguous() and not all(op.src_whole for op in kp.ops):
            src = src.contiguous()
        direct = src is tensor  # only views of live tensors, replayed from the caller's tensor as it is
        views: list[tuple[Callable[..., Any], CopyOp]] = []
        for op in kp.ops:
            if layer is not None and op.layer != layer:
                continue
            bands = self._banded.get(op.layer) if self._banded else None
            band = bands.get(op.tensor) if bands is not None else None
            if band is not None:
                info = self.state.layers[op.layer]
                write = self._writes.band_writer(band, *band_target(info, band, op),
                                                 info.records[op.tensor].dtype, op.layer)
                write(src if op.src_whole else _src_view(op, src))
                views.append((write, op))
                continue
            ou = self._unit_open.get(op.layer) if self._unit_open else None
            if ou is not None:
                self._write_unit(ou, kp.name, op, src if op.src_whole else _src_view(op, src))
                direct = False
                continue
            base, staged = self._target(op)
            direct = direct and not staged
            if base is None:
                continue
            dst = dst_view(base, op)
            # Staging is read by its layer's processing within this call: written at once. Live storage
            # is read by nothing before the update ends: small copies wait for one grouped launch.
            copy: Callable[..., Any] = self._writes.copier(dst) if direct else dst.copy_
            copy(src if op.src_whole else _src_view(op, src))
            views.append((copy, op))
        return views, direct

    def _check_lent(self, ol: OpenLayer) -> None:
        """After processing from borrowed memory: if the processor kept a reference to it (kernel state
        wrapping its input), process the layer again from a private copy and never borrow for it again.

        No other borrowing layer was open meanwhile (see ``lend_batch``), so any growth of the use count
        of the caller's storage since the layer opened is a reference this processing kept.
        """
        kept = any(storage_uses(anchor) > uses for anchor, uses in ol.lent.values())
        ol.lent.clear()
        sources, ol.sources = ol.sources, {}
        if not kept:
            return
        info = ol.info
        log.warning(
            "processing %s kept a reference to its input; it is processed again from a copy and its "
            "inputs are copied from now on", info.name,
        )
        info.reads_input = False
        self._lenders.discard(info.name)
        self._touched.discard(info.name)
        self._processed_done.remove(info.name)
        attrs = len(self._attr_snapshots)
        self._open_processed(info)
        for name, tensor in sources.items():
            self._replay(self.plan.keys[name], tensor, info.name)
        self._complete(self._open[info.name])
        # The snapshot taken by the first processing holds the attributes from before the update; this
        # one would hold the reference into the caller's memory.
        del self._attr_snapshots[attrs:]

    def _carry_band(self, layer: str, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A private copy of a band whose one-scale matrix still misses rows: that matrix's staging, on
        the device within the budget, else in host memory; (copy, whether in host memory)."""
        nbytes = src.nbytes
        # Other layers only: the matrix being carried is already among the waiting ones.
        self._note_waiting(layer, self._waiting_layers() - {layer})
        spill, where, pin = self._placement(nbytes)
        copy = torch.empty(src.shape, dtype=src.dtype, device=where, pin_memory=pin)
        copy.copy_(src)
        self._hold(nbytes, spill)
        return copy, spill

    def _matrix_written(self, layer: str) -> None:
        """A one-scale matrix of ``layer`` is whole and about to be quantized into the live tensors: from
        here the layer counts as written (rollback snapshot first)."""
        if layer not in self._touched:
            self._snapshot(self.state.layers[layer])
            self._touched.add(layer)

    # ------------------------------------------------------------------ writers other than load()
    # The sharded plane's region sink and the in-place delta applier write keys their own way; these are
    # the session steps they share with load(), so completion, byte counts and rollback stay one account.
    def mark_applied(self, name: str, nbytes: int) -> None:
        """Count key ``name`` (``nbytes`` received) as arrived, written by the caller's own path."""
        self._require_open()
        if name in self._arrived:
            raise DuplicateTensorError(f"{name}: arrived twice in update {self.version!r}")
        self._arrived.add(name)
        self._num_bytes += nbytes
        if self.expected is not None and name not in self.expected:
            self._unannounced_applied += 1

    def count_received(self, nbytes: int) -> None:
        """Add ``nbytes`` received for this update (a region: a part of a key) to its byte count."""
        self._num_bytes += nbytes

    def write_region(self, name: str, op: CopyOp, src: torch.Tensor) -> None:
        """Copy ``src`` (a region of key ``name``) along ``op`` into its live tensor or its layer's staging.

        The layer is prepared as for load() - snapshot for rollback, staging opened - but never on the
        band path: a region is any box of a model-format tensor, not a run of whole rows.
        """
        self._require_open()
        if op.layer not in self.state.layers:
            raise LayoutMismatchError(f"{name}: a region writes into {op.layer}.{op.tensor}, and the model "
                                      f"has no layer {op.layer!r}")
        if op.layer in self._banded:
            # Its live tensors are quantized band by band from whole keys: a raw region copy into them
            # would write model-format bytes into the kernel tensors.
            raise UpdateStateError(f"{name}: a region writes into {op.layer}, which this update quantizes "
                                   "band by band from whole keys; one layer cannot take both")
        self._prepare(op.layer, bands=False)
        ou = self._unit_open.get(op.layer) if self._unit_open else None
        if ou is not None:
            self._write_unit(ou, name, op, src)
            return
        base, _ = self._target(op)
        if base is None:  # pragma: no cover - only borrowed staging has none, and regions never lend
            raise UpdateStateError(f"{name}: {op.layer}.{op.tensor} is borrowed staging, which a region "
                                   "cannot write")
        base.as_strided(op.dst_size, op.dst_stride, base.storage_offset() + op.dst_offset).copy_(src)

    def complete_regions(self, name: str) -> None:
        """Every region of key ``name`` was written with :meth:`write_region`: the key has arrived, and the
        layers (or units) it was the last key of complete."""
        self.mark_applied(name, 0)
        self._replayed += 1
        self._key_written(name, self.plan.keys[name])

    def _target(self, op: CopyOp) -> tuple[torch.Tensor | None, bool]:
        """Where ``op`` writes: (a plain tensor on the destination's storage, whether it is staging).

        Staging is written through its raw buffer and live tensors through a detached alias: neither
        carries a Parameter subclass, so copies into them skip Python ``__torch_function__`` handlers
        (vLLM's parameters define one) and autograd view tracking. Borrowed staging has no raw buffer:
        None, nothing to write.
        """
        ol = self._open.get(op.layer)
        if ol is not None:
            raw = ol.raw.get(op.tensor)
            if raw is None:
                assert op.tensor in ol.lent
                return None, True
            return raw[1], True
        mod = self.state.layers[op.layer].module
        t: torch.Tensor | None = mod._parameters.get(op.tensor)
        if t is None:
            t = mod._buffers[op.tensor]
        assert t is not None  # the plan only records tensors the layer owns
        return t.detach(), False

    def _prepare(self, layer: str, *, bands: bool = True) -> None:
        """Make ``layer`` ready to receive data: snapshot (rollback) a direct layer, open a processed one
        (``bands=False``: staged even where its keys could be quantized band by band - a caller writing
        arbitrary regions of model-format tensors)."""
        if layer in self._open or layer in self._touched or layer in self._unit_open or layer in self._banded:
            return
        info = self.state.layers[layer]
        if info.direct:
            self._snapshot(info)
            self._touched.add(layer)
            return
        banded = self._bands_of(info) if bands else None
        if banded is not None:
            # Quantized key by key into the live tensors (reload/bands.py): they change from the first
            # key on, as a direct layer's do - except a layer made only of one-scale matrices, whose
            # live tensors change when its first matrix is whole (_matrix_written).
            self._banded[layer] = banded
            if len(banded) < len(info.records) or not all(b.matrix_rows for b in banded.values()):
                self._snapshot(info)
                self._touched.add(layer)
            self._processed_done.append(layer)
            if self._lend:
                self._lend.pop(layer, None)
            return
        if info.unit_processor is not None and self._open_units(info):
            return
        self._open_processed(info, self._lend.pop(layer, None) if self._lend else None)

    def _bands_of(self, info: LayerInfo) -> dict[str, RowBands] | None:
        """``info``'s band quantizers if it takes the band path in this update (decided once per update)."""
        if info.direct:
            return None
        try:
            return self._band_layers[info.name]
        except KeyError:
            bands = self._band_layers[info.name] = layer_bands(self.plan, info)
            return bands

    def __enter__(self) -> UpdateSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self._fail(exc)
        elif self._status == "open":
            self.finish()

    @property
    def loading(self) -> bool:
        """Whether a ``load`` call of this session is running (its loaders are its own writes)."""
        return self._loading > 0

    @property
    def status(self) -> str:
        """'open', 'finished' or 'aborted'."""
        return self._status


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    for b in model.buffers():
        if b.device.type != "meta":
            return b.device
    return torch.device("cpu")


_FLOATS = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point
)


def _src_view(op: CopyOp, src: torch.Tensor) -> torch.Tensor:
    """The slice of the incoming (contiguous) tensor that ``op`` copies from."""
    return src.as_strided(op.src_size, op.src_stride, src.storage_offset() + op.src_offset)
