"""Processed layers of an update: staging while keys arrive, processing, copy-back into the kernel tensors.

A processed layer (online quantization, repacking) gets model-format staging when its first key arrives
(or, for a read-only processor, borrows the caller's memory where it already is that staging: see
:mod:`weight_sync.reload.borrow`); when its last key
arrives the processor runs, the resulting kernel tensors are copied into the kernel tensors that existed
before, and those objects (and addresses) are reinstalled. Staging buffers are pooled by layout and
reused only when nothing else references them. ``ProcessedLayers`` holds these steps for
:class:`~weight_sync.reload.session.UpdateSession`, which owns the state they read and write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from weight_sync.errors import LayoutMismatchError
from weight_sync.layers.meta import install_tensor, rematerialize
from weight_sync.layers.tensors import graph_visible_tensors
from weight_sync.quant.online import RELOAD_TARGETS
from weight_sync.reload.plan import Plan
from weight_sync.reload.state import LayerInfo, ModelState
from weight_sync.reload.validation import fmt_layout
from weight_sync.reload.writes import WriteQueue

__all__ = ["Lend", "OpenLayer", "ProcessedLayers", "sole_owner", "storage_use_count", "storage_uses"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Lend:
    """A layer's borrowed staging: record name -> the caller's tensor at its first element, and the
    caller's tensor of every key of the layer (to process it again from a copy if needed)."""

    anchors: dict[str, torch.Tensor]
    sources: dict[str, torch.Tensor]


@dataclass(slots=True)
class OpenLayer:
    """A processed layer whose keys are still arriving: its staging and the kernel objects it replaced."""

    info: LayerInfo
    remaining: set[str]
    staging: dict[str, torch.Tensor]
    params: dict[str, Any]
    buffers: dict[str, Any]
    tensor_attrs: dict[str, torch.Tensor]
    extra_attrs: dict[str, Any]
    nbytes: int
    spilled: bool
    # Raw staging buffers (and their pool keys), handed back for reuse once the layer is processed.
    raw: dict[str, tuple[tuple, torch.Tensor]] = field(default_factory=dict)
    # Borrowed staging: record name -> (the caller's tensor it starts at, that storage's use count before
    # the layer referenced it), and the caller's tensor of every key (to process again from a copy).
    lent: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    sources: dict[str, torch.Tensor] = field(default_factory=dict)


class ProcessedLayers:
    """The processed-layer steps of an update session (the session's state is declared here, set there)."""

    model: nn.Module
    state: ModelState
    plan: Plan
    device: torch.device
    version: Any
    rollback: bool
    budget_bytes: int
    expected: frozenset[str] | None
    _open: dict[str, OpenLayer]
    _touched: set[str]
    _snapshots: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]
    _staging_pool: dict[tuple, list[torch.Tensor]]
    _attr_snapshots: list[tuple[nn.Module, frozenset[str], dict[str, Any]]]
    _processed_done: list[str]
    _first_processed: list[LayerInfo]
    # Layers processed unit by unit (see reload/units.py): open ones, those done, and the layers that
    # offer a per-unit processor but took the layer path this update, with why.
    _unit_open: dict[str, Any]
    _per_unit: list[str]
    _unit_fallbacks: dict[str, str]
    _num_units: int
    # Staging bytes held now and at most, on the model's device and in host memory (spilled beyond the
    # budget), and the layers that waited for keys while another layer opened (out of layer order).
    _buffered: int
    _peak: int
    _host_held: int
    _host_peak: int
    _held_peak: int
    _spilled: int
    _waited: set[str]
    _writes: WriteQueue
    _seconds: dict[str, float]
    _host: torch.device
    _lenders: set[str]
    _lend: dict[str, Lend]
    # Installs direct weight_loader routing on a tensor (set while initialize_layerwise_reload routes).
    route: Callable[[str, str, torch.Tensor], Any] | None

    def _snapshot(self, info: LayerInfo, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Host copies of the layer's live tensors (or of ``tensors``), taken before their first write."""
        if not self.rollback or info.name in self._snapshots:
            return
        snaps = []
        live = graph_visible_tensors(info.module) if tensors is None else tensors
        for t in live.values():
            if t.device.type != "meta":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda).copy_(t) \
                    if t.is_contiguous() else t.detach().to("cpu", copy=True)
                snaps.append((t, host))
        self._snapshots[info.name] = snaps

    def _open_processed(self, info: LayerInfo, lend: Lend | None = None) -> None:
        """Install model-format staging on a processed layer, keeping its kernel objects for later.

        ``lend`` names tensors whose staging is a view of the caller's memory (starting at the given
        tensor): never zero-filled, never pooled, not counted against the budget.
        """
        mod = info.module
        nbytes = info.model_format_bytes
        lent: dict[str, tuple[torch.Tensor, int]] = {}
        if lend is not None:
            for name, anchor in lend.anchors.items():
                # Counted before any view of ours exists: more uses after processing mean a reference kept.
                lent[name] = (anchor, storage_uses(anchor))
                nbytes -= info.records[name].nbytes  # the caller's memory, not staging
        self._note_waiting(info.name, self._waiting_layers())
        spill, where, pin = self._placement(nbytes)
        # Zero fill keeps regions no loader writes (padding) deterministic; tensors the plan's copies
        # overwrite entirely skip it. Only when completion is by expected keys: then a processed layer
        # is never processed before every one of its keys (and so every recorded copy) has arrived.
        written = self.plan.fully_written(info.name, info.records) if self.expected is not None else frozenset()
        raw: dict[str, tuple[tuple, torch.Tensor]] = {}
        staging: dict[str, torch.Tensor] = {}
        for name, rec in info.records.items():
            if name in lent:
                view = lent[name][0].as_strided(rec.shape, rec.stride)
                staging[name] = rematerialize(rec, where, data=view)
                continue
            key = (rec.shape, rec.stride, rec.dtype, where, pin)
            data = self._reusable(key)
            if data is None:
                data = torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=where, pin_memory=pin)
            if name not in written:
                data.zero_()
            raw[name] = (key, data)
            staging[name] = rematerialize(rec, where, pin=pin, data=data)
        if self.route is not None:
            for name, t in staging.items():
                self.route(info.name, name, t)
        # One pass over the module's attributes: tensors to reinstall later, and non-tensor attributes a
        # processor added (flags, handles) that the layer must lose while it is back in model format.
        extra: dict[str, Any] = {}
        tensor_attrs: dict[str, torch.Tensor] = {}
        for k, v in vars(mod).items():
            if isinstance(v, torch.Tensor):
                tensor_attrs[k] = v
            elif k not in info.initial_attrs:
                extra[k] = v
        ol = OpenLayer(
            info=info,
            remaining=set(self.plan.layer_keys.get(info.name, set())),
            staging=staging,
            params=dict(mod._parameters),
            buffers=dict(mod._buffers),
            tensor_attrs=tensor_attrs,
            extra_attrs=extra,
            nbytes=nbytes,
            spilled=spill,
            raw=raw,
            lent=lent,
            sources=lend.sources if lend is not None else {},
        )
        # Back to model format: flags a processor set (e.g. "already processed") must not survive,
        # or the processor would skip the new weights.
        for k in extra:
            del mod.__dict__[k]
        for rec in info.records.values():
            install_tensor(mod, rec, staging[rec.name])
        self._open[info.name] = ol
        self._hold(nbytes, spill)
        if spill:
            log.debug("update %r: staging %d bytes of %s in host memory (budget %d bytes)",
                      self.version, nbytes, info.name, self.budget_bytes)

    def _waiting_layers(self) -> set[str]:
        """Layers holding staging that still waits for keys: open layers, units with staging, one-scale
        matrices missing rows."""
        waiting = set(self._open)
        if self._unit_open:
            waiting.update(n for n, ou in self._unit_open.items() if ou.staging)
        if self._writes.matrices:
            waiting.update(self._writes.waiting_layers())
        return waiting

    def _note_waiting(self, layer: str, waiting: set[str]) -> None:
        """``layer`` opens staging while ``waiting`` still wait for keys: the stream is out of layer (or
        unit) order. Reported once per update, when it ends, with the bytes really held (see
        ``UpdateSession._report_buffering``)."""
        if waiting:
            self._waited.update(waiting)
            self._waited.add(layer)

    def _placement(self, nbytes: int) -> tuple[bool, torch.device, bool]:
        """(spill, device, pinned) of ``nbytes`` of new staging: the model's device within the budget,
        else host memory (pinned on CUDA)."""
        spill = self._buffered + nbytes > self.budget_bytes
        return spill, self._host if spill else self.device, spill and self.device.type == "cuda"

    def _release(self, nbytes: int, spill: bool) -> None:
        """``nbytes`` of staging counted by :meth:`_hold` are no longer held."""
        if spill:
            self._host_held -= nbytes
        else:
            self._buffered -= nbytes

    def _hold(self, nbytes: int, spill: bool) -> None:
        """Count ``nbytes`` of staging opened on the device, or in host memory (spilled) when ``spill``."""
        if spill:
            self._spilled += nbytes
            self._host_held += nbytes
            self._host_peak = max(self._host_peak, self._host_held)
        else:
            self._buffered += nbytes
            self._peak = max(self._peak, self._buffered)
        self._held_peak = max(self._held_peak, self._buffered + self._host_held)

    def _complete(self, ol: OpenLayer) -> None:
        """Process a layer whose keys have all arrived and copy its kernel tensors into the old ones."""
        info, mod = ol.info, ol.info.module
        t0 = time.perf_counter()
        if ol.spilled:
            for rec in info.records.values():
                on_device = ol.staging[rec.name].detach().to(self.device)
                install_tensor(mod, rec, rematerialize(rec, self.device, data=on_device))
        assert info.processor is not None
        old = {**ol.params, **ol.buffers, **ol.tensor_attrs}
        old = {k: v for k, v in old.items() if v is not None and not v.is_meta}
        if info.processed:
            # A processor may write its outputs straight into the live kernel tensors (they are offered
            # as ``mod.ws_reload_targets``) instead of allocating new ones that are then copied back: no
            # transient copy of the layer's kernel tensors, no copy-back. So the rollback snapshot of
            # those tensors is taken before the processor runs, not after.
            self._snapshot(info, old)
            # From here the live tensors may change: a failure must roll back or mark the model torn.
            self._touched.add(info.name)
            mod.__dict__[RELOAD_TARGETS] = old
        try:
            info.processor(mod)
        finally:
            mod.__dict__.pop(RELOAD_TARGETS, None)
        t1 = time.perf_counter()
        produced = graph_visible_tensors(mod)
        if info.processed:
            for k in produced:
                if k not in old:
                    raise LayoutMismatchError(
                        f"{info.name}.{k}: processing produced a tensor the live layer did not have"
                    )
            for k, dst in old.items():
                new = produced.get(k)
                if new is None:
                    raise LayoutMismatchError(
                        f"{info.name}.{k}: processing no longer produces this kernel tensor"
                    )
                if new.shape != dst.shape or new.dtype != dst.dtype:
                    raise LayoutMismatchError(
                        f"{info.name}.{k}: kernel tensor is {fmt_layout(tuple(dst.shape), dst.dtype)}, "
                        f"processing produced {fmt_layout(tuple(new.shape), new.dtype)}"
                    )
            # The layer currently holds the processor's outputs; the old kernel tensors are in `old`.
            if self.rollback:
                # Kernel state a processor keeps outside tensors (e.g. a oneDNN handle holding prepacked
                # weights on CPU) is replaced, not copied into: keep the previous objects for rollback.
                self._attr_snapshots.append((mod, info.initial_attrs, dict(ol.extra_attrs)))
            self._touched.add(info.name)
            for k, dst in old.items():
                new = produced[k]
                # Equal shapes: an empty kernel tensor (a weight the processor moved into a handle)
                # has nothing to copy.
                if new is not dst and dst.numel() and not _same_memory(new, dst):
                    dst.copy_(new)
            self._restore_objects(ol, keep_new_attrs=True)
        else:
            # First processing: the live tensors were model format (or meta); the processor's outputs
            # become the kernel tensors, so their addresses are new by design.
            self._touched.add(info.name)
            self._first_processed.append(info)
        del self._open[info.name]
        self._release(ol.nbytes, ol.spilled)
        ol.staging.clear()
        self._recycle(ol)
        self._processed_done.append(info.name)
        self._seconds["process"] += t1 - t0
        self._seconds["copy_back"] += time.perf_counter() - t1

    def _recycle(self, ol: OpenLayer) -> None:
        """Retire a processed layer's staging buffers into the pool (reuse is decided when needed)."""
        for key, data in ol.raw.values():
            self._staging_pool.setdefault(key, []).append(data)
        ol.raw.clear()

    def _reusable(self, key: tuple) -> torch.Tensor | None:
        """A retired buffer of this layout that nothing references any more, if there is one.

        Ownership is checked at reuse, not at retirement: by then the views the loading code held
        are gone, while a processor that kept its input (kernel state wrapping the weight, or the
        kernel tensors of a first processing) still holds it, and that buffer is never handed out.
        """
        free = self._staging_pool.get(key)
        if not free:
            return None
        for i, data in enumerate(free):
            if sole_owner(data):
                return free.pop(i)
        return None

    def _restore_objects(self, ol: OpenLayer, *, keep_new_attrs: bool) -> None:
        mod = ol.info.module
        d = mod.__dict__
        initial = ol.info.initial_attrs
        tensor_keys: list[str] = []
        new_extra: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, torch.Tensor):
                tensor_keys.append(k)
            elif k not in initial:
                new_extra[k] = v
        mod._parameters.clear()
        mod._parameters.update(ol.params)
        mod._buffers.clear()
        mod._buffers.update(ol.buffers)
        for k in tensor_keys:
            del d[k]
        d.update(ol.tensor_attrs)
        if keep_new_attrs:
            d.update(new_extra)  # the processor's attributes win over a reinstalled one of the same name
        else:
            for k in new_extra:
                del d[k]
            d.update(ol.extra_attrs)

    # ------------------------------------------------------------------ ending


storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view exactly the same elements (an output written in place)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def sole_owner(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor using its storage (so reusing the bytes cannot change anyone's
    data). Without the counter (another torch build), nothing is reused."""
    if storage_use_count is None:
        return False
    # The temporary storage object made here holds one reference besides ``t``'s own.
    return storage_use_count(t.untyped_storage()._cdata) <= 2


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors use ``t``'s storage (requires the counter, see :func:`sole_owner`)."""
    assert storage_use_count is not None
    return storage_use_count(t.untyped_storage()._cdata)
