"""Processed layers quantized band by band as their keys arrive: no staging, no layer-wide pass.

A reload of an online-quantized layer normally stages the layer's model-format weight (q, k and v
copied into one fused qkv), then quantizes the whole of it into the live kernel tensors: the weight is
read twice and written once more than it needs to be, and the layer's keys are held until the last
one arrives. Where every scale belongs to rows of one key's band - per-channel scales, and 128x128
block scales when each key's rows start on a tile boundary (q/k/v heads, gate/up halves, an
expert's slices) - each key can be quantized on arrival, straight from the caller's tensor into its
rows of the live fp8/int8 weight and scales: one read and one write, bitwise the same bytes
(:class:`~weight_sync.quant.online.RowBands` states why).

A layer takes this path on a reload when its quant method offers bands for a tensor
(``row_bands``), every recorded copy into that tensor is such a band (full rows, aligned), the copies
cover it whole (no zero-filled padding to keep), and every other tensor of the layer is copied as it
is (a bias). Everything else of the lifecycle is unchanged: the rollback snapshot is taken before the
first write, the pointer audit sees the same tensors, the fingerprint reads the same bytes.
"""

from __future__ import annotations

import torch

from weight_sync.quant.online import RowBands
from weight_sync.reload.plan import CopyOp, Plan, contiguous_strides
from weight_sync.reload.state import LayerInfo

__all__ = ["band_target", "layer_bands"]


def layer_bands(plan: Plan, info: LayerInfo) -> dict[str, RowBands] | None:
    """The band quantizers of ``info``'s tensors for this reload, or None if the layer is processed whole."""
    if info.direct or not info.processed:
        return None
    qm = getattr(info.module, "quant_method", None)
    offer = getattr(qm, "row_bands", None)
    if offer is None or info.processor != qm.process_weights_after_loading:  # type: ignore[union-attr]
        return None
    bands: dict[str, RowBands] = {}
    for name, rec in info.records.items():
        rb = offer(info.module, name, rec.shape) if rec.stride == contiguous_strides(rec.shape) else None
        if rb is not None:
            bands[name] = rb
        else:
            live: torch.Tensor | None = info.module._parameters.get(name)
            if live is None:
                live = info.module._buffers.get(name)
            if live is None or tuple(live.shape) != rec.shape or live.dtype != rec.dtype or live.stride() != rec.stride:
                return None  # processing changes this tensor: the layer is processed whole
    if not bands:
        return None
    cached = plan.bands.get(info.name)
    if cached is None:
        cached = plan.bands[info.name] = _ops_are_bands(plan, info, bands)
    return bands if cached else None


def _ops_are_bands(plan: Plan, info: LayerInfo, bands: dict[str, RowBands]) -> bool:
    """Whether every copy of the layer's keys into a banded tensor writes whole aligned rows, and they
    cover each such tensor exactly once (so no byte of it keeps a zero fill or an older value)."""
    keys = [plan.keys[k] for k in plan.layer_keys.get(info.name, ())]
    if not keys or any(kp.mode != "copy" for kp in keys):
        return False
    covered = plan.fully_written(info.name, info.records)
    rows_written: dict[str, int] = {}
    for kp in keys:
        for op in kp.ops:
            if op.layer != info.name or op.tensor not in bands:
                continue
            where = _band(op, info.records[op.tensor].shape)
            if where is None:
                return False
            rows = op.dst_size[0]
            n = info.records[op.tensor].shape[-2]
            row, align = where[1], bands[op.tensor].align
            if row % align or (rows % align and row + rows != n):
                return False
            rows_written[op.tensor] = rows_written.get(op.tensor, 0) + rows
    for name, rec in info.records.items():
        if name in bands:
            matrices = rec.shape[0] if len(rec.shape) == 3 else 1
            # Covered whole, and by exactly as many rows as it has: no row written twice.
            if name not in covered or rows_written.get(name, 0) != matrices * rec.shape[-2]:
                return False
    return True


def _band(op: CopyOp, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(matrix, first row) of a copy that writes whole rows of one matrix of a contiguous 2-D or stacked
    3-D tensor of ``shape``, else None."""
    if len(shape) not in (2, 3) or len(op.dst_size) != 2:
        return None
    n, k = shape[-2], shape[-1]
    rows, cols = op.dst_size
    if cols != k or op.dst_stride != (k, 1) or op.dst_offset % k:
        return None
    matrix, row = divmod(op.dst_offset // k, n)
    if row + rows > n or matrix >= (shape[0] if len(shape) == 3 else 1):
        return None
    return matrix, row


def band_target(info: LayerInfo, band: RowBands, op: CopyOp) -> tuple[torch.Tensor, torch.Tensor]:
    """The live (qweight rows, scale rows) the band ``op`` writes."""
    where = _band(op, info.records[op.tensor].shape)
    assert where is not None  # layer_bands checked every op of the layer
    return band.target(info.module, where[0], where[1], op.dst_size[0])
