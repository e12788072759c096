"""Expert-granular reload: a processed layer made of independently quantizable units completes per unit.

A processed layer opts in by offering a per-unit processor, ``fn(module, units, staging, targets)``
(``quant_method.process_units`` of the processor that runs, or ``module.ws_process_units``). Its units
are found from the plan (:func:`layer_units`): every model-format tensor of the layer is stacked along
dim 0 (``[E, ...]``, as fused experts are) and each key's recorded copies write inside one index of that
dim, so the keys group by the index they write: an expert's w1/w3 slices of ``w13_weight`` and its w2.

On a reload, when the kernel tensors exist, a unit gets model-format staging of one slice of every
tensor (``rec.shape[1:]``) when its first key arrives; when its last key arrives the processor writes it
straight into its slices of the live kernel tensors, and the staging is pooled for the next unit. The
module never leaves kernel format, so nothing is reinstalled. The budget and the spill rule apply per
unit: a stream in block order holds one unit (plus the non-unit layer in flight); out of order, units
beyond the budget are staged in host memory.

Everything else takes the layer path (:mod:`weight_sync.reload.processing`): the first load (there are
no kernel tensors to write into yet), processors without a per-unit hook (genuinely layer-wide
processing, e.g. one scale over all experts), keys the plan cannot replay as copies, a key writing into
two units, units no key writes, and updates without a key list (no completion by keys).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from weight_sync.errors import IncompleteUpdateError, LayoutMismatchError
from weight_sync.layers.meta import TensorRecord
from weight_sync.layers.tensors import graph_visible_tensors
from weight_sync.reload.plan import CopyOp, Plan, span
from weight_sync.reload.processing import ProcessedLayers
from weight_sync.reload.state import LayerInfo, name_list

__all__ = ["LayerUnits", "OpenUnits", "UnitLayers", "UnitProcessor", "layer_units"]

log = logging.getLogger(__name__)

#: ``fn(module, units, staging, targets)``: process local units ``units`` from ``staging`` (record name ->
#: model-format ``[len(units), *rec.shape[1:]]``) into their slices of the live kernel tensors ``targets``.
UnitProcessor = Callable[[nn.Module, Sequence[int], Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], None]


@dataclass(frozen=True, slots=True)
class LayerUnits:
    """How a layer's keys split into units: key -> unit, unit -> its keys, per tensor its dim-0 stride."""

    unit_of: dict[str, int]
    keys: dict[int, frozenset[str]]
    strides: dict[str, int]
    unit_bytes: int  # model-format bytes of one unit's staging


@dataclass(slots=True)
class OpenUnits:
    """A layer processed unit by unit during an update: what each unit waits for, open units' staging."""

    info: LayerInfo
    units: LayerUnits
    process: UnitProcessor
    # The live kernel tensors at the start (the processor writes into them; they must stay these).
    targets: dict[str, torch.Tensor]
    remaining: dict[int, set[str]]
    # Open unit -> record name -> (pool key, staging buffer), and whether the unit went to host memory.
    staging: dict[int, dict[str, tuple[tuple, torch.Tensor]]] = field(default_factory=dict)
    spilled: dict[int, bool] = field(default_factory=dict)


def layer_units(plan: Plan, info: LayerInfo) -> LayerUnits | str:
    """The units of ``info``'s layer under ``plan``, or why it has none (cached on the plan)."""
    cached = plan.units.get(info.name)
    if cached is None:
        cached = plan.units[info.name] = _find_units(plan, info)
    return cached


def _find_units(plan: Plan, info: LayerInfo) -> LayerUnits | str:
    recs = info.records
    leading = {rec.shape[0] if len(rec.shape) >= 2 else -1 for rec in recs.values()}
    if len(leading) != 1 or -1 in leading:
        return "its tensors are not stacked along one leading dimension"
    (num,) = leading
    for rec in recs.values():
        if rec.stride[0] < span(tuple(rec.shape[1:]), tuple(rec.stride[1:])):
            return f"the slices of {rec.name} along dim 0 overlap"
    unit_of: dict[str, int] = {}
    keys: dict[int, set[str]] = {}
    for name in plan.layer_keys.get(info.name, ()):
        kp = plan.keys[name]
        if kp.mode != "copy":
            return f"key {name} is loaded by the model's loader, not by recorded copies"
        found = set()
        for op in kp.ops:
            if op.layer != info.name:
                continue
            dst = recs.get(op.tensor)
            unit = _unit_of(op, dst) if dst is not None else None
            if unit is None:
                return f"key {name} writes across the dim-0 slices of {op.tensor}"
            found.add(unit)
        if len(found) != 1:
            return f"key {name} writes into {len(found)} units, expected 1"
        unit_of[name] = found.pop()
        keys.setdefault(unit_of[name], set()).add(name)
    if len(keys) != num:
        return f"the plan's keys write {len(keys)} of its {num} units"
    unit_bytes = sum(
        span(tuple(r.shape[1:]), tuple(r.stride[1:])) * r.dtype.itemsize for r in recs.values()
    )
    return LayerUnits(
        unit_of=unit_of,
        keys={u: frozenset(k) for u, k in keys.items()},
        strides={n: r.stride[0] for n, r in recs.items()},
        unit_bytes=unit_bytes,
    )


def _unit_of(op: CopyOp, rec: TensorRecord) -> int | None:
    """The dim-0 index of ``rec`` whose slice contains every element ``op`` writes (None if none does)."""
    s0 = rec.stride[0]
    unit, rel = divmod(op.dst_offset, s0)
    last = rel + span(op.dst_size, op.dst_stride) - 1
    inner = span(tuple(rec.shape[1:]), tuple(rec.stride[1:]))
    if not 0 <= unit < rec.shape[0] or last >= inner:
        return None
    return unit


class UnitLayers(ProcessedLayers):
    """The unit steps of an update session (its state is declared in ProcessedLayers, set there)."""

    def _init_units(self) -> None:
        self._unit_open = {}
        self._per_unit = []
        self._unit_fallbacks = {}
        self._num_units = 0

    def _open_units(self, info: LayerInfo) -> bool:
        """Take the unit path for ``info`` if it can (see the module docstring); whether it did."""
        process = info.unit_processor
        if process is None or info.direct:
            return False
        units: LayerUnits | str
        if not info.processed:
            units = "first load: the kernel tensors are made by processing the whole layer"
        elif self.expected is None:
            units = "no key list for this update: layers complete at its end"
        elif self._lend and info.name in self._lend:
            units = "processed from the caller's memory (borrowed)"
        else:
            units = layer_units(self.plan, info)
        if isinstance(units, str):
            self._unit_fallbacks[info.name] = units
            log.debug("update %r: %s is processed as one layer: %s", self.version, info.name, units)
            return False
        self._unit_open[info.name] = OpenUnits(
            info=info,
            units=units,
            process=process,
            targets=graph_visible_tensors(info.module),
            remaining={u: set(k) for u, k in units.keys.items()},
        )
        return True

    def _unit_staging(self, ou: OpenUnits, unit: int) -> dict[str, tuple[tuple, torch.Tensor]]:
        """The staging of ``unit``, opened (on the device within the budget, else in host memory) if new."""
        bufs = ou.staging.get(unit)
        if bufs is not None:
            return bufs
        info, nbytes = ou.info, ou.units.unit_bytes
        # Another unit of this layer with staging counts too: units out of order.
        self._note_waiting(info.name, self._waiting_layers())
        spill, where, pin = self._placement(nbytes)
        # Zero fill only where the recorded copies leave gaps: a tensor they write whole is written
        # whole unit by unit too, since every key writes inside one unit's slice.
        written = self.plan.fully_written(info.name, info.records)
        bufs = {}
        for name, rec in info.records.items():
            shape, stride = tuple(rec.shape[1:]), tuple(rec.stride[1:])
            key = (shape, stride, rec.dtype, where, pin)
            data = self._reusable(key)
            if data is None:
                data = torch.empty_strided(shape, stride, dtype=rec.dtype, device=where, pin_memory=pin)
            if name not in written:
                data.zero_()
            bufs[name] = (key, data)
        ou.staging[unit], ou.spilled[unit] = bufs, spill
        self._hold(nbytes, spill)
        return bufs

    def _write_unit(self, ou: OpenUnits, key: str, op: CopyOp, src: torch.Tensor) -> None:
        """Copy ``src`` (the slice of key ``key`` that ``op`` copies) into its unit's staging."""
        unit = ou.units.unit_of[key]
        data = self._unit_staging(ou, unit)[op.tensor][1]
        offset = op.dst_offset - unit * ou.units.strides[op.tensor]
        data.as_strided(op.dst_size, op.dst_stride, data.storage_offset() + offset).copy_(src)

    def _unit_arrived(self, layer: str, key: str) -> None:
        """Key ``key`` of unit layer ``layer`` is written: process its unit once that unit is complete."""
        ou = self._unit_open.get(layer)
        if ou is None:
            return
        unit = ou.units.unit_of[key]
        left = ou.remaining[unit]
        left.discard(key)
        if left:
            return
        self._complete_unit(ou, unit)
        del ou.remaining[unit]
        if not ou.remaining:
            self._finish_units(ou)

    def _complete_unit(self, ou: OpenUnits, unit: int) -> None:
        """Process a complete unit straight into its slices of the live kernel tensors."""
        info = ou.info
        t0 = time.perf_counter()
        if info.name not in self._touched:
            # The first unit writes into the live kernel tensors: the rollback snapshot of the whole
            # layer is taken before it, and from here a failure must roll back or tear the layer.
            self._snapshot(info)
            self._touched.add(info.name)
        bufs = ou.staging.pop(unit)
        spilled = ou.spilled.pop(unit)
        staging = {}
        for name, (_, data) in bufs.items():
            staging[name] = (data.to(self.device) if spilled else data).unsqueeze(0)
        ou.process(info.module, [unit], staging, ou.targets)
        staging.clear()
        for key, data in bufs.values():
            self._staging_pool.setdefault(key, []).append(data)
        self._release(ou.units.unit_bytes, spilled)
        self._num_units += 1
        self._seconds["process"] += time.perf_counter() - t0

    def _finish_units(self, ou: OpenUnits) -> None:
        """After the layer's last unit: the processor wrote into the live kernel tensors and made none."""
        info = ou.info
        produced = graph_visible_tensors(info.module)
        for k in produced:
            if k not in ou.targets:
                raise LayoutMismatchError(
                    f"{info.name}.{k}: per-unit processing produced a tensor the live layer did not have"
                )
        for k, live in ou.targets.items():
            if produced.get(k) is not live:
                raise LayoutMismatchError(
                    f"{info.name}.{k}: per-unit processing must write into the live kernel tensor, "
                    f"found it replaced by {'nothing' if k not in produced else 'another tensor'}"
                )
        del self._unit_open[info.name]
        self._processed_done.append(info.name)
        self._per_unit.append(info.name)

    def _reinstall_units(self) -> None:
        """On abort: the live kernel tensors go back on their modules if a processor replaced them (their
        bytes are restored from the snapshots or torn, as for any written layer)."""
        for ou in self._unit_open.values():
            mod = ou.info.module
            for k, live in ou.targets.items():
                if k in mod._parameters:
                    mod._parameters[k] = live  # type: ignore[assignment]
                elif k in mod._buffers:
                    mod._buffers[k] = live
                else:
                    mod.__dict__[k] = live
        self._unit_open.clear()

    def _check_units_complete(self) -> None:
        """At finish: a unit layer still waiting for keys cannot be processed (each needs all its keys)."""
        for ou in self._unit_open.values():
            missing = sorted(k for keys in ou.remaining.values() for k in keys)
            raise IncompleteUpdateError(
                f"layer {ou.info.name} needs processing and so needs all of its tensors; "
                f"missing {name_list(missing)}",
                tuple(missing),
            )
