"""Borrowing: which processed layers can take the caller's memory itself as their model-format staging.

A processed layer whose processor only reads its input (``LayerInfo.reads_input``) is processed, and every
reference to its staging dropped, before ``load`` returns once all of its keys are in one ``load`` call. A
staging tensor may then be the caller's memory instead of a copy of it:

* a single key that fills one tensor whole with that tensor's layout (:func:`lend_single`), or
* for a list or tuple passed to ``load`` (a network bucket: views of one buffer, packed back to back),
  keys whose whole-tensor copies tile a contiguous tensor row-major and that lie in the caller's memory
  exactly as they would in the fused tensor (:func:`lend_batch`): q/k/v into qkv, gate/up into gate_up.

What can tile is a property of the plan, computed once per layer and cached per model
(:func:`layer_tiling`); a batch only compares pointers against it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from weight_sync.reload.plan import KeyPlan, Plan
from weight_sync.reload.processing import Lend, storage_use_count

if TYPE_CHECKING:
    from collections.abc import Sequence

    from weight_sync.reload.processing import ProcessedLayers
    from weight_sync.reload.state import LayerInfo

__all__ = ["LayerTiling", "RecordTiling", "layer_tiling", "lend_batch", "lend_single", "lenders"]

# Tensor subclasses may carry their own storage rules; only these are lent out as staging.
_PLAIN = (torch.Tensor, nn.Parameter)


@dataclass(frozen=True, slots=True)
class RecordTiling:
    """How a layer's keys tile one contiguous model-format tensor: (key, byte offset, numel) by offset."""

    name: str
    dtype: torch.dtype
    nbytes: int
    tiles: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class LayerTiling:
    """The tileable tensors of a layer, valid while its key plans are these objects (plans are replaced,
    never mutated, when a key is planned again; a model recorded again gets a new plan). Holds nothing
    that references a module, so the cache never keeps a model alive."""

    kps: tuple[KeyPlan, ...]
    keys: tuple[str, ...]
    records: tuple[RecordTiling, ...]


# Per model, per layer name. Keyed by the model (as the reload state itself is) so it lasts across updates.
_TILINGS: weakref.WeakKeyDictionary[nn.Module, dict[str, LayerTiling]] = weakref.WeakKeyDictionary()


def lenders(s: ProcessedLayers) -> set[str]:
    """Layers of the session that may borrow at all: reloads of read-only processed layers, completed by
    expected keys (so within the ``load`` call that brings their last key)."""
    if s.expected is None or storage_use_count is None:
        return set()
    return {n for n, i in s.state.layers.items() if i.reads_input and i.processed and not i.direct}


def lend_single(s: ProcessedLayers, name: str, tensor: torch.Tensor, kp: KeyPlan) -> Lend | None:
    """Borrow ``tensor`` itself as the staging of the layer it alone fills whole, in the same layout.

    Only when that staging would otherwise be on the device (within the budget), and never while a layer
    lent by a batch is open (their reference counts must not overlap, see ``UpdateSession._check_lent``).
    """
    if len(kp.ops) != 1 or s.expected is None or storage_use_count is None:
        return None
    op = kp.ops[0]
    info = s.state.layers[op.layer]
    if (
        not info.reads_input
        or not info.processed
        or info.direct
        or not op.src_whole
        or op.dst_offset != 0
        or op.layer in s._open
        or op.layer in s._touched
        or s.plan.layer_keys.get(op.layer) != {name}
        or s._buffered + info.model_format_bytes > s.budget_bytes  # would be staged on host
    ):
        return None
    rec = info.records.get(op.tensor)
    if (
        rec is None
        or op.dst_size != rec.shape
        or op.dst_stride != rec.stride
        or tensor.dtype != rec.dtype
        or tensor.stride() != rec.stride
        or tensor.device != s.device
        or type(tensor) not in _PLAIN
        or any(ol.lent for ol in s._open.values())
    ):
        return None
    return Lend({op.tensor: tensor}, {name: tensor})


def lend_batch(s: ProcessedLayers, batch: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Lend]:
    """Layers all of whose keys are in ``batch`` and lie in the caller's memory as their staging would.

    Per layer, each tileable tensor whose tiles are adjacent in one storage, in order, in its dtype and on
    the model's device is borrowed; the layer's other tensors are staged as usual. Layers are chosen in
    batch order so that no two borrowing layers are open at once. Anything unusual (a key the plan does
    not know yet, an item that is not a pair) borrows nothing: the normal path handles or rejects it.
    """
    lend_from = s._lenders
    keys = s.plan.keys
    index: dict[str, torch.Tensor] = {}
    spans: dict[str, list[int]] = {}  # layer -> [first, last] position of its keys, in first-seen order
    try:
        for i, (name, tensor) in enumerate(batch):
            kp = keys.get(name)
            if kp is None:
                return {}  # planned on arrival: the plan of a layer may still grow during this batch
            for layer in kp.layers:
                if layer in lend_from:
                    index[name] = tensor
                    span = spans.get(layer)
                    if span is None:
                        spans[layer] = [i, i]
                    else:
                        span[1] = i
    except (TypeError, ValueError):
        return {}
    out: dict[str, Lend] = {}
    end = -1
    cache = _tilings_of(s.model)
    for layer, (first, last) in spans.items():
        if first <= end or layer in s._open or layer in s._touched:
            continue
        tiling = layer_tiling(s.model, s.plan, s.state.layers[layer], cache)
        if not tiling.records:
            continue
        sources = {}
        for key in tiling.keys:
            t = index.get(key)
            if t is None:
                break
            sources[key] = t
        else:
            anchors = _adjacent(tiling, index, s.device)
            if anchors:
                out[layer] = Lend(anchors, sources)
                end = last
    return out


def _adjacent(
    tiling: LayerTiling, index: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Record name -> first tile's tensor, for records whose tiles lie back to back in one storage."""
    anchors: dict[str, torch.Tensor] = {}
    for rt in tiling.records:
        first = index[rt.tiles[0][0]]
        if (
            type(first) not in _PLAIN
            or first.dtype != rt.dtype
            or first.device != device
            or first.numel() != rt.tiles[0][2]
            or not first.is_contiguous()
        ):
            continue
        storage = first.untyped_storage()
        # The view spans the record from the first tile: it must stay inside that tile's storage.
        if first.storage_offset() * first.element_size() + rt.nbytes > storage.nbytes():
            continue
        sid, base = storage._cdata, first.data_ptr()
        for key, offset, numel in rt.tiles[1:]:
            t = index[key]
            if (
                type(t) not in _PLAIN
                or t.data_ptr() != base + offset
                or t.dtype != rt.dtype
                or t.numel() != numel
                or not t.is_contiguous()
                or t.untyped_storage()._cdata != sid
            ):
                break
        else:
            anchors[rt.name] = first
    return anchors


def _tilings_of(model: nn.Module) -> dict[str, LayerTiling]:
    cache = _TILINGS.get(model)
    if cache is None:
        cache = _TILINGS[model] = {}
    return cache


def layer_tiling(
    model: nn.Module, plan: Plan, info: LayerInfo, cache: dict[str, LayerTiling] | None = None
) -> LayerTiling:
    """The layer's tileable tensors, from the cache while the layer's key plans are unchanged."""
    if cache is None:
        cache = _tilings_of(model)
    entry = cache.get(info.name)
    names = plan.layer_keys.get(info.name, ())
    if entry is not None and len(entry.kps) == len(names):
        keys = plan.keys
        for kp in entry.kps:
            if keys.get(kp.name) is not kp:
                break
        else:
            return entry
    entry = cache[info.name] = _tile(info, tuple(plan.keys[n] for n in sorted(names)))
    return entry


def _tile(info: LayerInfo, kps: tuple[KeyPlan, ...]) -> LayerTiling:
    """Records that the layer's keys fill exactly, each key whole into one row-major region.

    A layer with a key loaded by its real loader has none: that loader would write into the caller's
    memory. A region must hold the key's elements in order (whole source, contiguous, same element count),
    and the regions must cover the record without gaps or overlaps.
    """
    keys = tuple(kp.name for kp in kps)
    if any(kp.mode != "copy" for kp in kps):
        return LayerTiling(kps, keys, ())
    regions: dict[str, list[tuple[int, str, int]]] = {}
    bad: set[str] = set()
    for kp in kps:
        numel = _numel(kp.shape)
        for op in kp.ops:
            if op.layer != info.name:
                continue
            if not op.src_whole or numel == 0 or _numel(op.dst_size) != numel \
                    or not _contiguous(op.dst_size, op.dst_stride):
                bad.add(op.tensor)
            else:
                regions.setdefault(op.tensor, []).append((op.dst_offset, kp.name, numel))
    records = []
    for name, tiles in regions.items():
        rec = info.records.get(name)
        if name in bad or rec is None or not _contiguous(rec.shape, rec.stride):
            continue
        tiles.sort()
        pos = 0
        for offset, _, numel in tiles:
            if offset != pos:
                break
            pos += numel
        else:
            if pos == _numel(rec.shape):
                size = rec.dtype.itemsize
                records.append(RecordTiling(
                    name, rec.dtype, pos * size, tuple((k, off * size, n) for off, k, n in tiles)
                ))
    return LayerTiling(kps, keys, tuple(records))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Row-major contiguity as torch defines it (dimensions of size 1 may have any stride)."""
    expected = 1
    for d, st in zip(reversed(shape), reversed(stride)):
        if d != 1 and st != expected:
            return False
        expected *= d
    return True
