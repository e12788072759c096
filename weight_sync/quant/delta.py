"""Requantizing only what a delta changed: kernel tensors bitwise equal to a full online quantization.

An engine that quantizes online cannot patch quantized bytes with full-precision changes; it keeps the
layer's *model-format* weight (the fused, TP-sharded, full-precision tensor its processor reads) as the
base of the next delta. :func:`apply_quantized_delta_` writes the changed values into that base and
rewrites only the kernel-tensor parts the changes reach:

- **block scales** (``fp8_block``): each tile's absmax is kept (:func:`delta_absmax`: fp32, one per
  tile) and moved by the changes alone: the largest new ``|value|`` of a tile if it reaches the old
  absmax, the old absmax if no changed element held it, and only where the element holding it was
  lowered (or a value is not finite) is the tile read. The tiles whose scale moved are requantized
  whole, together (one gather of a (tiles, bn, bk) batch); in the others only the changed elements;
- **per-channel scales** (``fp8_per_channel``, ``int8``): the rows that contain a change;
- **per-tensor scale** (``fp8``): this rank's absmax is kept and moved the same way (the whole base is
  read only when the max element was lowered), then MAX-reduced over the TP group like the full
  quantization; if the new scale equals the live one, only the changed elements are requantized,
  otherwise the whole tensor is.

Why it is exact: every quantization here is a function of (element, its scale) once the scale is known,
and a scale is a function of its row / tile / tensor only. Requantizing a row or tile alone therefore
runs the same fp32 division, clamp and cast on the same inputs as the full quantization does
(``quant/fp8.py``'s chunked loop, ``quant/int8.py``); padding a ragged tile with zeros cannot change
``max(max, -min)``. Where most of a tensor is touched the full quantization is simply run instead.
The kept absmax is exact too: a max is exact in any order, and after the changes a tile's (tensor's)
absmax is the larger of its unchanged elements' and its changed elements' new ones, where the
unchanged elements' is the old absmax unless a changed element held it (then the tile is read). It is
kept clamped at 1e-12 as the scale is (``clamp(absmax, 1e-12) / 448``): below that the scale does not
depend on it.

Fused layers: a change at flat position ``p`` of the checkpoint tensor ``q_proj`` lands at
``p + row_offset * cols`` of the fused ``qkv`` base (:func:`fused_positions`).

Limitations: the registry's methods only (an unknown method falls back to its full ``quantize``); 2-D
weights; on CUDA the exactness relies on the Triton kernels being bitwise equal to the torch path, which
``quant/fp8.py`` states and ``tests/quant/test_fp8_gpu.py`` checks for full quantizations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from weight_sync.errors import ConfigError, LayoutMismatchError
from weight_sync.quant.base import LinearMethod
from weight_sync.quant.fp8 import _EPS, FP8_MAX, Fp8LinearMethod, _absmax, _scale
from weight_sync.quant.int8 import Int8LinearMethod, quantize_int8
from weight_sync.quant.online import OnlineQuantLinearMethod, reduce_max

__all__ = ["DeltaRequant", "apply_quantized_delta_", "delta_absmax", "fused_positions"]

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


def delta_absmax(method: LinearMethod, base: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """The absmax state a delta maintains for ``method`` (None where it keeps none), for ``base`` whose
    live scales are ``scale``: fp32 ``clamp(max |x|, 1e-12)`` per block tile (the scale's shape) or, for
    a per-tensor scale, of this rank's shard (shape ``(1,)``), on ``scale``'s device.

    Pass it to every following :func:`apply_quantized_delta_` of the same ``base``; the deltas keep it
    current, so they need not read the whole base. Block tiles of a 2-byte base take it from ``scale``
    (no read of the base, see :func:`_absmax_from_scale`); otherwise one read of ``base``.
    """
    if not isinstance(method, Fp8LinearMethod) or method.config.granularity == "channel":
        return None
    if method.config.granularity == "tensor":
        return _read_absmax(base, scale.device)
    if base.dtype in (torch.bfloat16, torch.float16):
        return _absmax_from_scale(scale, base.dtype)
    return _read_tile_absmax(base, *method.config.block_size, scale.device)


def apply_quantized_delta_(
    method: LinearMethod,
    base: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    absmax: torch.Tensor | None = None,
) -> DeltaRequant:
    """Write ``values`` at flat ``positions`` (distinct, as :func:`~weight_sync.transport.delta.decode_delta`
    gives them) of the model-format ``base`` and requantize in place only the parts of ``qweight`` /
    ``scale`` (the live kernel tensors) the changes reach.

    Afterwards ``qweight`` and ``scale`` are bitwise equal to ``method.quantize(base)``. ``base`` may
    live on the host while the kernel tensors live on the device; the touched parts travel. With a
    per-tensor scale and a TP ``group`` every rank must call this for the same layer (it all-reduces).
    ``absmax``: the state :func:`delta_absmax` made for this base (block and per-tensor scales), kept
    current here in place; without it, it is made first.
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
    vals = values.to(base.device, base.dtype).reshape(-1)
    flat = base.view(-1)
    if isinstance(method, Fp8LinearMethod) and method.config.granularity != "channel":
        block = method.config.granularity == "block"
        if absmax is None and block:
            absmax = delta_absmax(method, base, scale)  # of the old base: the state the changes move
        if absmax is not None:
            want = tuple(scale.shape) if block else (1,)
            if tuple(absmax.shape) != want or absmax.dtype != torch.float32 or absmax.device != scale.device:
                raise LayoutMismatchError(f"absmax state must be fp32 {want} on {scale.device}, got "
                                          f"{absmax.dtype} {tuple(absmax.shape)} on {absmax.device}")
        old = flat[pos]
        flat[pos] = vals
        if block:
            assert absmax is not None
            return _tiles(method, base, pos, old, vals, qweight, scale, absmax)
        return _per_tensor(method, base, pos, old, vals, qweight, scale, group, absmax)
    flat[pos] = vals
    if isinstance(method, Fp8LinearMethod):
        return _rows(method, base, pos, qweight, scale)
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


def _absmax_from_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each tile's ``clamp(absmax, 1e-12)`` recovered from its scale ``clamp(absmax, 1e-12) / 448``, for a
    base of 2-byte float ``dtype``, without reading the base.

    Exact: the absmax is a ``dtype`` value (a max of elements), and two such values above 1e-12 differ
    by at least 2**-11 relatively (8 or 11 significant bits), while the fp32 division and the product
    back each err by at most 2**-24: rounding ``scale * 448`` to ``dtype`` gives the absmax back. A scale
    of ``1e-12 / 448`` is the clamp's (absmax <= 1e-12). Non-finite scales stay non-finite (the delta
    then reads those tiles). Relies on ``scale`` being what the quantization made of the base.
    """
    back = torch.mul(scale, scale.new_full((), FP8_MAX)).to(dtype).float()
    floor = _scale(scale.new_zeros(()))
    return torch.where(scale.view(torch.int32) == floor.view(torch.int32), scale.new_full((), _EPS), back)


def _read_absmax(base: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """The whole base's ``clamp(absmax, 1e-12)`` (fp32, shape (1,), on ``dev``) from one read."""
    return _absmax(base.to(dev)).clamp(min=_EPS).reshape(1)


def _read_tile_absmax(base: torch.Tensor, bn: int, bk: int, dev: torch.device) -> torch.Tensor:
    """Every tile's ``clamp(absmax, 1e-12)`` (fp32, on ``dev``) from one read of the whole base."""
    n, k = base.shape
    nb, kb = -(-n // bn), -(-k // bk)
    v = base.to(dev)
    if n % bn or k % bk:
        # Zero padding cannot change max(max, -min) of a ragged tile (module docstring).
        v = v.new_zeros(nb * bn, kb * bk)
        v[:n, :k] = base
    if dev.type == "cpu":
        # max(max, -min) per tile as _absmax computes it, reduced over each tile row's bk elements
        # and then over its bn rows, in fp32 (exact for every float weight: max and min are exact in
        # any order); torch's CPU reductions of bf16, or over two strided dims, are 4-5x slower.
        f = v.float().view(-1, bk)
        hi = f.amax(dim=1).view(nb, bn, kb).amax(dim=1)
        lo = f.amin(dim=1).view(nb, bn, kb).amin(dim=1)
        return torch.maximum(hi, -lo).clamp_(min=_EPS)
    return _absmax(v.view(nb, bn, kb, bk), dim=(1, 3)).clamp_(min=_EPS)


def _changed_maxima(index: torch.Tensor, new: torch.Tensor, old: torch.Tensor, size: int) -> torch.Tensor:
    """Per unit (``size`` of them; ``index`` puts each change in one), fp32 rows: max |new value| (a
    NaN or infinity counts as +inf, which sends its unit to a read), max |old value|, and 1 where a
    change lands (0 elsewhere): one scatter for the three."""
    src = torch.stack([new, old, torch.ones_like(new)]).float().abs_().nan_to_num_(nan=math.inf, posinf=math.inf)
    return src.new_zeros(3, size).scatter_reduce_(1, index.expand(3, -1), src, "amax")


_FP8_MAX_ON: dict[torch.device, torch.Tensor] = {}


def _fp8_max(device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 448 on ``device``, made once: :func:`_scale`'s divisor (the ordinary division path)."""
    t = _FP8_MAX_ON.get(device)
    if t is None:
        t = _FP8_MAX_ON[device] = torch.full((), FP8_MAX, dtype=torch.float32, device=device)
    return t


_TILE_INDEX: dict[tuple[int, int, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _tile_index(n: int, k: int, bn: int, bk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For an (n, k) weight of whole tiles: each tile's first flat position and the flat offsets of a
    tile's elements from it, (bn, bk); kept per shape (a model has a handful)."""
    key = (n, k, bn, bk, device)
    out = _TILE_INDEX.get(key)
    if out is None:
        if len(_TILE_INDEX) >= 64:
            _TILE_INDEX.clear()
        starts = ((torch.arange(n // bn, device=device) * (bn * k))[:, None]
                  + torch.arange(k // bk, device=device) * bk).reshape(-1)
        within = torch.arange(bn, device=device)[:, None] * k + torch.arange(bk, device=device)
        out = _TILE_INDEX[key] = (starts, within)
    return out


def _tile_elements(ids: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    """Flat positions of tiles ``ids``' elements, (tiles, bn, bk); a ragged tile's missing rows / columns
    repeat its last ones (clamped indices)."""
    if n % bn == 0 and k % bk == 0:
        starts, within = _tile_index(n, k, bn, bk, ids.device)
        return starts[ids][:, None, None] + within
    kb = -(-k // bk)
    rows = (ids // kb * bn)[:, None] + torch.arange(bn, device=ids.device)
    cols = (ids % kb * bk)[:, None] + torch.arange(bk, device=ids.device)
    if n % bn:
        rows.clamp_(max=n - 1)
    if k % bk:
        cols.clamp_(max=k - 1)
    return rows[:, :, None] * k + cols[:, None, :]


def _tiles(method: Fp8LinearMethod, base: torch.Tensor, pos: torch.Tensor, old: torch.Tensor, new: torch.Tensor,
           qweight: torch.Tensor, scale: torch.Tensor, absmax: torch.Tensor) -> DeltaRequant:
    """Block scales: ``base`` already holds ``new`` at ``pos`` (``old`` were there); ``absmax`` is the
    old base's per-tile state (:func:`delta_absmax`), moved here to the new base's."""
    if pos.numel() == 0:
        return DeltaRequant("tile", 0, False)
    bn, bk = method.config.block_size
    n, k = base.shape
    nb, kb = -(-n // bn), -(-k // bk)
    dev = qweight.device
    m, sf = absmax.view(-1), scale.view(-1)
    p = pos.to(dev)
    tile_of = torch.add((p % k) // bk, p // (k * bn), alpha=kb)
    # Each tile's new absmax from the changes alone: the largest |new| if it reaches the old absmax;
    # the old one if no changed element held it; otherwise (the max element lowered) unknown without
    # a read of the tile. Non-finite values and states are read too (as _absmax of the tile would).
    new_max, old_max, hit = _changed_maxima(tile_of, new.to(dev), old.to(dev), m.numel())
    read = (old_max == m) & (new_max < m)
    torch.maximum(m, new_max, out=m)  # exact for every tile not read below
    # m >= 1e-12: dividing by 448 is _scale(m) without its clamp.
    moved = torch.div(m, _fp8_max(dev)).view(torch.int32) != sf.view(torch.int32)
    whole = read | ~torch.isfinite(m) | moved
    # The one host sync: the batch of tiles to rewrite whole needs its size.
    num_touched, num_whole = (int(x) for x in torch.stack([hit, whole.float()]).sum(1).tolist())
    if num_whole > _FULL_FRACTION * nb * kb:
        _full(method, base, qweight, scale, None)
        fresh = delta_absmax(method, base, scale)
        assert fresh is not None  # a block method keeps one
        absmax.copy_(fresh)
        return DeltaRequant("tile", num_touched, True)
    if num_whole:
        # The tiles whose scale moved (or whose absmax needs the read), requantized together: one
        # gather of their elements as a (tiles, bn, bk) batch. A ragged tile's repeated elements no
        # more change its max(max, -min) than the full quantization's zero padding does, and their
        # bytes are written twice, identically.
        ids = torch.nonzero_static(whole, size=num_whole).reshape(-1)
        at = _tile_elements(ids.to(base.device), n, k, bn, bk)
        tiles = base.view(-1)[at].to(dev)
        a = _absmax(tiles, dim=(1, 2)).clamp_(min=_EPS)
        s = torch.div(a, _fp8_max(dev))  # _scale(a), whose clamp a has had
        m[ids] = a
        sf[ids] = s
    # Every changed element with its tile's (now final) scale: an element's fp8 value is a function of
    # it and that scale. Elements of whole tiles are written again, identically, below.
    q = torch.div(new.to(dev), sf[tile_of]).clamp_(-FP8_MAX, FP8_MAX)
    raw = _raw(qweight).view(-1)
    raw[p] = _raw(q.to(qweight.dtype))  # fp8 has no index kernels: move the bytes
    if num_whole:
        # As quantize_fp8: the fp32 division by the tile's scale, clamp, cast.
        qt = torch.div(tiles, s[:, None, None]).clamp_(-FP8_MAX, FP8_MAX).to(qweight.dtype)
        raw[at.to(dev)] = _raw(qt)
    return DeltaRequant("tile", num_touched, False)


def _per_tensor(method: Fp8LinearMethod, base: torch.Tensor, pos: torch.Tensor, old: torch.Tensor,
                new: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, group: dist.ProcessGroup | None,
                absmax: torch.Tensor | None) -> DeltaRequant:
    """A per-tensor scale: ``base`` already holds ``new`` at ``pos``; ``absmax`` (optional) is this
    rank's state (:func:`delta_absmax`) of the old base, moved here to the new base's."""
    dev = qweight.device
    if absmax is None:
        local = _read_absmax(base, dev)  # one read of the base, as before
    elif pos.numel() == 0:
        local = absmax
    else:
        # As for a tile (_tiles): the changes decide the new absmax unless they lowered the max element.
        new_max, old_max, _ = _changed_maxima(torch.zeros_like(pos, device=dev), new.to(dev), old.to(dev), 1)
        local = torch.maximum(absmax, new_max)
        if bool(((old_max == absmax) & (new_max < absmax)) | ~torch.isfinite(local)):
            local = _read_absmax(base, dev)
        absmax.copy_(local)
    # Every rank takes part in the reduction even with nothing changed locally, since another rank's
    # change moves the shared scale (max of the clamped absmaxes = the clamp of their max).
    new_scale = _scale(reduce_max(local.clone(), group))
    if not torch.equal(new_scale.view(torch.int32), scale.reshape(1).view(torch.int32)):
        return _full(method, base, qweight, scale, group)
    if pos.numel() > _FULL_FRACTION * base.numel():
        # Same scale, most elements changed: the cast of everything, without another reduction.
        qweight.view(-1).copy_(torch.div(base.to(qweight.device).view(-1), scale.reshape(1)).clamp_(-FP8_MAX, FP8_MAX))
        return DeltaRequant("element", pos.numel(), True)
    q = torch.div(new.to(dev), scale.reshape(1)).clamp_(-FP8_MAX, FP8_MAX).to(qweight.dtype)
    _raw(qweight).view(-1)[pos.to(dev)] = _raw(q)
    return DeltaRequant("element", pos.numel(), False)
