"""Where each checkpoint key of a delta lands in place: its routes (one :class:`Target` per copy).

The plan already says where every checkpoint element lands: a :class:`~weight_sync.reload.plan.CopyOp`
copies a (row-strided) slice of the checkpoint tensor into a contiguous run of a layer tensor. A key
whose copies all have that shape gets a route (``weight_sync.reload.delta_apply`` explains the two
kinds, ``live`` and ``quant``); keys without one take the session path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from weight_sync.quant.online import OnlineQuantLinearMethod
from weight_sync.reload.plan import Plan, contiguous_strides
from weight_sync.reload.state import LayerInfo, ModelState

__all__ = ["Target", "key_targets", "live_tensor", "plan_routes", "select"]

_ITEM_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class Target:
    """Where one copy of a checkpoint tensor lands in place.

    The copy reads ``rows`` x ``cols`` elements of the (contiguous) checkpoint tensor starting at
    ``src_offset`` with ``src_row_stride`` elements between rows, and writes them as one contiguous run
    at element ``dst_offset`` of the destination (relative to the live tensor's start, or of the
    model-format copy).
    """

    layer: str
    tensor: str
    kind: str  # 'live' or 'quant' (module docstring)
    src_offset: int
    rows: int
    cols: int
    src_row_stride: int
    dst_offset: int
    whole: bool  # the copy reads the whole checkpoint tensor as it is

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def live_tensor(mod: nn.Module, name: str) -> torch.Tensor | None:
    t: torch.Tensor | None = mod._parameters.get(name)
    if t is None:
        t = mod._buffers.get(name)
    return t


def _usable(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type != "meta" and t.is_contiguous() and t.dtype.itemsize in _ITEM_SIZES


def _kind(info: LayerInfo, tensor: str) -> str | None:
    """How a copy into ``info``'s ``tensor`` is applied in place, or None (the session path)."""
    mod = info.module
    live = live_tensor(mod, tensor)
    if info.direct:
        return "live" if _usable(live) else None
    if info.unit_processor is not None or not info.processed:
        return None
    method = getattr(mod, "quant_method", None)
    rec = info.records.get(tensor)
    if not isinstance(method, OnlineQuantLinearMethod) or rec is None:
        return None
    if tensor == "weight":
        q, s = live_tensor(mod, "weight"), live_tensor(mod, "weight_scale")
        ok = (q is not None and s is not None and len(rec.shape) == 2 and tuple(q.shape) == tuple(rec.shape)
              and tuple(rec.stride) == contiguous_strides(tuple(rec.shape)))
        return "quant" if ok else None
    # Online quantization replaces the weight only: the layer's other tensors stay as loaded.
    if _usable(live) and live is not None and live.dtype == rec.dtype and tuple(live.shape) == tuple(rec.shape):
        return "live"
    return None


def key_targets(state: ModelState, plan: Plan, name: str) -> tuple[Target, ...] | None:
    kp = plan.keys.get(name)
    if kp is None or kp.mode != "copy" or not kp.ops:
        return None
    total = math.prod(kp.shape)
    out = []
    for op in kp.ops:
        info = state.layers.get(op.layer)
        if info is None or tuple(op.dst_size) != tuple(op.src_size):
            return None
        size = tuple(op.src_size)
        if tuple(op.dst_stride) != contiguous_strides(size):
            return None
        # The source: contiguous, or the rows of a wider tensor (a column shard).
        if tuple(op.src_stride) == contiguous_strides(size):
            rows, cols, row_stride = 1, math.prod(size), math.prod(size)
        elif len(size) == 2 and op.src_stride[1] == 1 and op.src_stride[0] >= size[1]:
            rows, cols, row_stride = size[0], size[1], op.src_stride[0]
        else:
            return None
        kind = _kind(info, op.tensor)
        if kind is None:
            return None
        whole = op.src_offset == 0 and rows * cols == total and row_stride == cols
        out.append(Target(op.layer, op.tensor, kind, op.src_offset, rows, cols, row_stride, op.dst_offset, whole))
    return tuple(out)


def plan_routes(state: ModelState, plan: Plan, names: Iterable[str]) -> dict[str, tuple[Target, ...] | None]:
    """Every key's in-place route (None: the session path), for the keys of one update."""
    routes = {name: key_targets(state, plan, name) for name in names}
    # A destination two keys write (tied weights, overlapping copies) may hold the other key's bytes:
    # it is no base for either key's delta.
    spans: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
    for name, targets in routes.items():
        for t in targets or ():
            spans.setdefault((t.layer, t.tensor), []).append((t.dst_offset, t.dst_offset + t.numel, name))
    for items in spans.values():
        items.sort()
        end, owner = -1, ""
        for lo, hi, name in items:
            if lo < end:
                routes[name] = routes[owner] = None
            if hi > end:
                end, owner = hi, name
    # The session processes a layer only from all of its keys: one key on the session path takes the
    # layer's other keys with it (repeated, since such a key may reach a further processed layer).
    changed = True
    while changed:
        changed = False
        for name in [n for n, r in routes.items() if r is None]:
            kp = plan.keys.get(name)
            for layer in kp.layers if kp is not None else ():
                info = state.layers.get(layer)
                if info is None or info.direct:
                    continue
                for other in plan.layer_keys.get(layer, ()):
                    if routes.get(other) is not None:
                        routes[other] = None
                        changed = True
    return routes


def select(t: Target, pos: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The changes that fall in ``t``'s copy, as element indices inside its destination run."""
    if t.whole:
        return pos, vals
    q = pos - t.src_offset
    if t.rows == 1:
        keep, at = (q >= 0) & (q < t.cols), q
    else:
        r, c = q // t.src_row_stride, q % t.src_row_stride
        keep, at = (q >= 0) & (r < t.rows) & (c < t.cols), r * t.cols + c
    # One nonzero for both selections (on CUDA each boolean index is a device sync).
    sel = keep.nonzero().view(-1)
    return at.index_select(0, sel), vals.index_select(0, sel)
