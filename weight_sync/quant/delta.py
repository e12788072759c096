"""Requantizing only what a delta changed: kernel tensors bitwise equal to a full online quantization.

An engine that quantizes online cannot patch quantized bytes with full-precision changes; it keeps the
layer's *model-format* weight (the fused, TP-sharded, full-precision tensor its processor reads) as the
base of the next delta. :func:`apply_quantized_delta_` writes the changed values into that base and
rewrites only the kernel-tensor parts the changes reach:

- **block scales** (``fp8_block``): the ``block_size`` tiles that contain a change (scale and values);
  when changes spread over many tiles (an RL step touches nearly all), one read of the base gives
  every tile's new scale, the tiles whose scale moved are rewritten whole and in the others only the
  changed elements are requantized;
- **per-channel scales** (``fp8_per_channel``, ``int8``): the rows that contain a change;
- **per-tensor scale** (``fp8``): the new scale is computed from the whole base (one read, MAX-reduced
  over the TP group like the full quantization); if it equals the live scale, only the changed elements
  are requantized, otherwise the whole tensor is.

Why it is exact: every quantization here is a function of (element, its scale) once the scale is known,
and a scale is a function of its row / tile / tensor only. Requantizing a row or tile alone therefore
runs the same fp32 division, clamp and cast on the same inputs as the full quantization does
(``quant/fp8.py``'s chunked loop, ``quant/int8.py``); padding a ragged tile with zeros cannot change
``max(max, -min)``. Where most of a tensor is touched the full quantization is simply run instead.

Fused layers: a change at flat position ``p`` of the checkpoint tensor ``q_proj`` lands at
``p + row_offset * cols`` of the fused ``qkv`` base (:func:`fused_positions`).

Limitations: the registry's methods only (an unknown method falls back to its full ``quantize``); 2-D
weights; on CUDA the exactness relies on the Triton kernels being bitwise equal to the torch path, which
``quant/fp8.py`` states and ``tests/quant/test_fp8_gpu.py`` checks for full quantizations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.quant.base import LinearMethod
from weight_sync.quant.fp8 import FP8_MAX, Fp8LinearMethod, _absmax, _scale
from weight_sync.quant.int8 import Int8LinearMethod, quantize_int8
from weight_sync.quant.online import OnlineQuantLinearMethod, reduce_max

__all__ = ["DeltaRequant", "apply_quantized_delta_", "fused_positions"]

# Beyond this fraction of a tensor's rows or tiles touched, one full quantization is cheaper than
# gathering the touched parts (and it is the same bytes either way).
_FULL_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class DeltaRequant:
    """What one layer's delta rewrote: the unit ('row', 'tile', 'element' or 'tensor'), how many of
    them, and whether the whole tensor was requantized."""

    unit: str
    num_units: int
    full: bool


def fused_positions(positions: torch.Tensor, row_offset: int, cols: int) -> torch.Tensor:
    """Flat positions of a shard (q/k/v, gate/up) as flat positions of the fused tensor it starts at
    row ``row_offset`` of (both row-major with ``cols`` columns)."""
    if row_offset < 0 or cols < 1:
        raise ConfigError(f"fused_positions needs row_offset >= 0 and cols >= 1, got {row_offset}, {cols}")
    return positions + row_offset * cols


def apply_quantized_delta_(
    method: LinearMethod,
    base: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    group: dist.ProcessGroup | None = None,
) -> DeltaRequant:
    """Write ``values`` at flat ``positions`` of the model-format ``base`` and requantize in place only
    the parts of ``qweight`` / ``scale`` (the live kernel tensors) the changes reach.

    Afterwards ``qweight`` and ``scale`` are bitwise equal to ``method.quantize(base)``. ``base`` may
    live on the host while the kernel tensors live on the device; the touched parts travel. With a
    per-tensor scale and a TP ``group`` every rank must call this for the same layer (it all-reduces).
    """
    if base.dim() != 2 or not base.is_contiguous():
        raise LayoutMismatchError(f"delta base must be a contiguous 2-D weight, got {tuple(base.shape)} {base.stride()}")
    if tuple(qweight.shape) != tuple(base.shape):
        raise LayoutMismatchError(
            f"quantized weight must have the base's shape {tuple(base.shape)}, got {tuple(qweight.shape)}"
        )
    if positions.numel() != values.numel():
        raise LayoutMismatchError(f"{positions.numel()} changed positions but {values.numel()} values")
    pos = positions.to(base.device, torch.int64).reshape(-1)
    base.view(-1)[pos] = values.to(base.device, base.dtype).reshape(-1)
    if isinstance(method, Fp8LinearMethod):
        granularity = method.config.granularity
        if granularity == "block":
            return _tiles(method, base, pos, qweight, scale)
        if granularity == "channel":
            return _rows(method, base, pos, qweight, scale)
        return _per_tensor(method, base, pos, qweight, scale, group)
    if isinstance(method, Int8LinearMethod):
        return _rows(method, base, pos, qweight, scale)
    if isinstance(method, OnlineQuantLinearMethod):
        return _full(method, base, qweight, scale, group)
    raise ConfigError(f"apply_quantized_delta_ needs an online quantization method, got {method.name!r}")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a 1-byte tensor (fp8 / int8) as uint8: the same storage."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def _full(method: OnlineQuantLinearMethod, base: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
          group: dist.ProcessGroup | None, unit: str = "tensor", num_units: int = 1) -> DeltaRequant:
    q, s = method.quantize(base.to(qweight.device), group, out=(qweight, scale))
    if q is not qweight:
        qweight.copy_(q)
    if s is not scale:
        scale.copy_(s.reshape(scale.shape))
    return DeltaRequant(unit, num_units, True)


def _rows(method: OnlineQuantLinearMethod, base: torch.Tensor, pos: torch.Tensor, qweight: torch.Tensor,
          scale: torch.Tensor) -> DeltaRequant:
    rows = torch.unique(pos // base.shape[1])
    if rows.numel() == 0:
        return DeltaRequant("row", 0, False)
    if rows.numel() > _FULL_FRACTION * base.shape[0]:
        return _full(method, base, qweight, scale, None, "row", rows.numel())
    part = base.index_select(0, rows).to(qweight.device)
    if isinstance(method, Int8LinearMethod):
        q, s = quantize_int8(part)
    else:
        q, s = method.quantize(part, None)  # per-channel: each row's scale is its own (no group)
    dev_rows = rows.to(qweight.device)
    _raw(qweight).index_copy_(0, dev_rows, _raw(q))  # fp8 has no index kernels: move the bytes
    scale.index_copy_(0, dev_rows, s)
    return DeltaRequant("row", rows.numel(), False)


def _tiles(method: Fp8LinearMethod, base: torch.Tensor, pos: torch.Tensor, qweight: torch.Tensor,
           scale: torch.Tensor) -> DeltaRequant:
    bn, bk = method.config.block_size
    n, k = base.shape
    nb, kb = -(-n // bn), -(-k // bk)
    tile_of = (pos // k) // bn * kb + (pos % k) // bk
    # Which tiles are touched: a count per tile (one pass over the changes, no sort).
    tiles = torch.bincount(tile_of, minlength=nb * kb).nonzero().reshape(-1)
    if tiles.numel() == 0:
        return DeltaRequant("tile", 0, False)
    if tiles.numel() * bn * bk * 8 < base.numel():
        # A few tiles: each one requantized whole, from its own read.
        for t in tiles.tolist():
            _requantize_tile(base, int(t), kb, bn, bk, qweight, scale)
        return DeltaRequant("tile", tiles.numel(), False)
    # Changes spread over many tiles (the usual RL step touches nearly every one): one read of the
    # base gives every tile's new scale; a tile whose scale did not move needs only its changed
    # elements requantized (an element's fp8 value is a function of it and its tile's scale), and
    # only the tiles whose scale moved are rewritten whole.
    dev = qweight.device
    b = base.to(dev)
    v = b
    if n % bn or k % bk:
        # Zero padding cannot change max(max, -min) of a ragged tile (module docstring).
        v = b.new_zeros(nb * bn, kb * bk)
        v[:n, :k] = b
    if dev.type == "cpu":
        # max(max, -min) per tile as _absmax computes it, reduced over each tile row's bk elements
        # and then over its bn rows, in fp32 (exact for every float weight: max and min are exact in
        # any order); torch's CPU reductions of bf16, or over two strided dims, are 4-5x slower.
        f = v.float().view(-1, bk)
        hi = f.amax(dim=1).view(nb, bn, kb).amax(dim=1)
        lo = f.amin(dim=1).view(nb, bn, kb).amin(dim=1)
        new_scale = _scale(torch.maximum(hi, -lo))
    else:
        new_scale = _scale(_absmax(v.view(nb, bn, kb, bk), dim=(1, 3)))
    moved = (new_scale.view(torch.int32) != scale.view(torch.int32)).reshape(-1)
    moved_tiles = moved.nonzero().reshape(-1).tolist()
    if len(moved_tiles) > _FULL_FRACTION * nb * kb:
        return _full(method, base, qweight, scale, None, "tile", tiles.numel())
    dev_tiles = tile_of.to(dev)
    keep = ~moved[dev_tiles]
    p = pos.to(dev)[keep]
    q = torch.div(b.view(-1)[p], scale.reshape(-1)[dev_tiles[keep]]).clamp_(-FP8_MAX, FP8_MAX)
    _raw(qweight).view(-1)[p] = _raw(q.to(qweight.dtype))  # fp8 has no index kernels: move the bytes
    for t in moved_tiles:
        _requantize_tile(b, int(t), kb, bn, bk, qweight, scale)
    return DeltaRequant("tile", tiles.numel(), False)


def _requantize_tile(base: torch.Tensor, t: int, kb: int, bn: int, bk: int, qweight: torch.Tensor,
                     scale: torch.Tensor) -> None:
    i, j = divmod(t, kb)
    rows, cols = slice(i * bn, (i + 1) * bn), slice(j * bk, (j + 1) * bk)
    tile = base[rows, cols].to(qweight.device)
    # As quantize_fp8: the scale from max(max, -min) of the tile, then an fp32 division, clamp, cast.
    s = _scale(_absmax(tile).reshape(1))
    scale[i, j] = s[0]
    qweight[rows, cols] = torch.div(tile, s).clamp_(-FP8_MAX, FP8_MAX).to(qweight.dtype)


def _per_tensor(method: Fp8LinearMethod, base: torch.Tensor, pos: torch.Tensor, qweight: torch.Tensor,
                scale: torch.Tensor, group: dist.ProcessGroup | None) -> DeltaRequant:
    # One read of the base gives the new scale; every rank takes part in the reduction even with nothing
    # changed locally, since another rank's change moves the shared scale.
    new_scale = _scale(reduce_max(_absmax(base.to(qweight.device)).reshape(1), group))
    if not torch.equal(new_scale.view(torch.int32), scale.reshape(1).view(torch.int32)):
        return _full(method, base, qweight, scale, group)
    if pos.numel() > _FULL_FRACTION * base.numel():
        # Same scale, most elements changed: the cast of everything, without another reduction.
        qweight.view(-1).copy_(torch.div(base.to(qweight.device).view(-1), scale.reshape(1)).clamp_(-FP8_MAX, FP8_MAX))
        return DeltaRequant("element", pos.numel(), True)
    vals = base.view(-1)[pos].to(qweight.device)
    q = torch.div(vals, scale.reshape(1)).clamp_(-FP8_MAX, FP8_MAX).to(qweight.dtype)
    _raw(qweight).view(-1)[pos.to(qweight.device)] = _raw(q)
    return DeltaRequant("element", pos.numel(), False)
