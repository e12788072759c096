"""Applying a batch of staged device deltas by address: no torch tensor per payload or per write.

On a device an engine copies each call's delta payloads out of the transport's bucket and applies a
batch of them together (``weight_sync.reload.delta_apply``). The bucket path made torch views of every
payload (header, regions, positions, values) and a :class:`~weight_sync.reload.scatter_many.ScatterWrite`
per write: a dozen torch calls per payload, which on the H100 hosts cost more host time than the
device spends on the whole delta of a small model. Here a payload is integers all the way:

1. :func:`stage_call` copies one call's payloads in one launch (one copy of their span when they lie
   back to back in the bucket, as the transport lays them out) and records their byte offsets;
2. :func:`apply_batch` reads every header and table in one gather, decides per payload from them
   (numpy, plus the cached destination of each of its targets) whether it can go by address, decodes
   those together (``weight_sync.transport.delta_staged``) and writes them with one grouped launch per
   item size and kind (``weight_sync.reload.scatter_many.scatter_rows``), old values kept and
   checksums moved as the bucket path does.

A payload goes by address when its table is the batched layout, it has no plain chunks, and every
target it has copies the whole key (no column shard) into a live tensor of the wire's dtype on the
buffer's device, or into the model-format copy of a weight that is requantized whole. The others
(and payloads whose checks fail, so that their error names them) take the bucket path from views of
the staged buffer. Every payload of the batch is checked before the first write of any.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weight_sync.errors import ConfigError
from weight_sync.reload.delta_routes import Target
from weight_sync.reload.scatter_many import scatter_rows

# ``update`` below is delta_apply's InPlaceUpdate, typed Any: delta_apply imports this module, and the
# package keeps its imports free of circles (tests/reload/test_import_graph.py).
__all__ = ["BY_ADDRESS_ENV", "FlatSnap", "StagedCall", "apply_batch", "by_address_enabled", "merge_calls",
           "stage_call"]

#: Environment variable choosing how CUDA engines apply staged delta batches: "1" or unset, by address
#: (checked against a full reload on a GPU by ``scripts/gpu_check.sh tests_delta delta_flat``, and under
#: the Triton interpreter on CPU); "0", through per-payload views (the path before it, kept as the
#: fallback and the benchmark's baseline).
BY_ADDRESS_ENV = "WEIGHT_SYNC_DELTA_BY_ADDRESS"

_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def by_address_enabled() -> bool:
    """Whether CUDA engines apply staged batches by address (:data:`BY_ADDRESS_ENV`, read when an update begins)."""
    value = os.environ.get(BY_ADDRESS_ENV, "1")
    if value not in ("0", "1"):
        raise ConfigError(f"{BY_ADDRESS_ENV} must be '0' or '1', got {value!r}")
    return value == "1"


@dataclass(slots=True, eq=False)
class StagedCall:
    """Payloads copied out of one call's bucket: payload ``i`` is ``buf[offsets[i] : offsets[i] + sizes[i]]``."""

    buf: torch.Tensor  # uint8, 1-D
    offsets: np.ndarray
    sizes: np.ndarray
    names: list[str]
    numel: np.ndarray
    dtypes: list[torch.dtype]
    targets: list[tuple[Target, ...]]


def stage_call(items: list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]]) -> StagedCall | None:
    """One call's payloads copied into a buffer of their own in one launch on the current stream (the
    transport reuses its bucket once the call returns); None when a payload is not a flat uint8 tensor
    of whole 8-byte words (the bucket path then refuses it by name)."""
    payloads = [p for _, p, _, _, _ in items]
    if not all(p.dtype == torch.uint8 and p.dim() == 1 and p.is_contiguous() for p in payloads):
        return None
    sizes = np.fromiter((p.numel() for p in payloads), dtype=np.int64, count=len(payloads))
    ptr = np.fromiter((p.data_ptr() for p in payloads), dtype=np.int64, count=len(payloads))
    if bool((sizes % 8).any()):
        return None  # encodings are whole 8-byte words: the bucket path names this one's problem
    total = int(sizes.sum())
    device = payloads[0].device
    if all(p.device == device for p in payloads) and bool((ptr[1:] == ptr[:-1] + sizes[:-1]).all()):
        # Back to back in one bucket: their span, read through the first payload's storage.
        buf = payloads[0].as_strided((total,), (1,)).clone() if total else payloads[0].clone()
    else:
        buf = torch.cat(payloads)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return StagedCall(buf, offsets, sizes, [n for n, *_ in items],
                      np.fromiter((n for _, _, n, _, _ in items), dtype=np.int64, count=len(items)),
                      [d for _, _, _, d, _ in items], [t for *_, t in items])


def merge_calls(calls: list[StagedCall]) -> StagedCall:
    """Several staged calls as one (their buffers joined in one launch)."""
    if len(calls) == 1:
        return calls[0]
    shift = np.concatenate([[0], np.cumsum([c.buf.numel() for c in calls])[:-1]])
    return StagedCall(torch.cat([c.buf for c in calls]), np.concatenate([c.offsets + s for c, s in zip(calls, shift)]),
                      np.concatenate([c.sizes for c in calls]), [n for c in calls for n in c.names],
                      np.concatenate([c.numel for c in calls]), [d for c in calls for d in c.dtypes],
                      [t for c in calls for t in c.targets])


@dataclass(slots=True, eq=False)
class FlatSnap:
    """The old values of one grouped launch of writes by address, restored on rollback: write ``k`` put
    ``counts[k]`` values at positions ``pos[k][0][pos[k][1]:][:counts[k]]`` of ``regions[k]``."""

    regions: list[torch.Tensor]
    pos: list[tuple[torch.Tensor, int]]
    counts: list[int]
    old: torch.Tensor

    def restore(self) -> None:
        ends = np.cumsum(self.counts).tolist()
        for region, (p, s), n, end in reversed(list(zip(self.regions, self.pos, self.counts, ends))):
            region[p[s : s + n]] = self.old[end - n : end]


def _plan(update: Any, targets: tuple[Target, ...], dtype: torch.dtype, changes: int,
          device: torch.device, whole: set[tuple[str, str]]) -> list[tuple[Target, Any, Any]] | None:
    """What a payload of ``changes`` changed elements writes by address, as (target, destination, layer)
    per target it reaches; None: it takes the bucket path. ``whole``: the weights this batch already
    sends to the whole requantization (a fused weight's later keys follow its first)."""
    out = []
    layers, applier = update.state.layers, update.applier
    for t in targets:
        if not t.whole:
            return None
        info = layers[t.layer]
        d: Any
        if t.kind == "live":
            if not changes:
                continue
            d = applier.live_dst(info, t)
            if d.dtype != dtype or d.device != device:
                return None
        else:
            d = q = applier.quant_dst(info, t)
            if not changes:
                if update.reduces(info.module):
                    return None
                continue
            key = (info.name, t.tensor)
            if q.base_dtype != dtype or q.base_device != device:
                return None
            if key not in update._whole and key not in whole and not update.requantize_whole(q, changes):
                return None
            whole.add(key)
        out.append((t, d, info))
    return out


def apply_batch(update: Any, call: StagedCall) -> None:
    """Decode, check and write a batch of staged payloads (module docstring); nothing is written before
    every payload of it has passed its checks. The keys were marked applied when staged."""
    from weight_sync.transport.delta import decode_delta, raise_failed
    from weight_sync.transport.delta_batch import decode_deltas
    from weight_sync.transport.delta_staged import decodable, decode_staged, staged_tables

    t0 = time.perf_counter()
    buf, offsets, sizes = call.buf, call.offsets, call.sizes
    device = buf.device
    item = np.fromiter((d.itemsize for d in call.dtypes), dtype=np.int64, count=len(call.dtypes))
    tab = staged_tables(buf, offsets, sizes, call.numel, item)
    ok = decodable(tab, offsets) & np.isin(item, list(_INT))
    changes = (tab.n_bits + tab.n_index).tolist()
    plans: list[list[tuple[Target, Any, Any]] | None] = [None] * len(call.names)
    whole: set[tuple[str, str]] = set()
    for i in np.flatnonzero(ok).tolist():
        plans[i] = _plan(update, call.targets[i], call.dtypes[i], changes[i], device, whole)
    fast = np.array([i for i, p in enumerate(plans) if p is not None], dtype=np.int64)
    slow = [i for i, p in enumerate(plans) if p is None]

    def views(at: list[int]) -> list[tuple[str, torch.Tensor, int, torch.dtype, tuple[Target, ...]]]:
        return [(call.names[i], buf[offsets[i] : offsets[i] + sizes[i]], int(call.numel[i]), call.dtypes[i],
                 call.targets[i]) for i in at]

    checks: list[tuple[torch.Tensor, str]] = []
    decoded = decode_staged(buf, offsets, tab, fast, call.numel, checks)
    slow_items = views(slow)
    slow_decoded = decode_deltas([(p, n, d) for _, p, n, d, _ in slow_items])  # raises on a bad payload
    try:
        raise_failed(checks)
    except Exception:
        for _, payload, n, d, _ in views(fast.tolist()):
            decode_delta(payload, n, d)  # the first bad payload raises its own error
        raise
    update.write_decoded(slow_items, slow_decoded, marked=True)
    _write(update, call, decoded, plans)
    update._write_queued()  # (nothing queued by _write; the bucket path's writes of slow payloads)
    update.flush()
    update.seconds["apply"] += time.perf_counter() - t0


def _write(update: Any, call: StagedCall, decoded: list, plans: list) -> None:
    """The writes of the payloads decoded by address: one grouped launch per item size into live
    tensors (old values kept for rollback, checksums moved into the update's slots) and one into
    model-format copies."""
    base = call.buf.data_ptr()
    # item size -> write columns (dst, pos, val, count, offset, slot) + what rollback needs per write
    live: dict[int, tuple[list[list[int]], list[torch.Tensor], list[tuple[torch.Tensor, int]]]] = {}
    copies: dict[int, list[list[int]]] = {}
    for sel, sp in decoded:
        bptr, iptr = sp.bpos.data_ptr(), sp.ipos.data_ptr()
        rows = zip(sel.tolist(), sp.b_start.tolist(), sp.n_bits.tolist(), sp.i_start.tolist(),
                   sp.n_index.tolist(), sp.values_at.tolist())
        for i, b0, nb, i0, ni, vat in rows:
            size = call.dtypes[i].itemsize
            parts = [(p, s, n, v) for p, s, n, v in ((sp.bpos, b0, nb, vat), (sp.ipos, i0, ni, vat + nb * size)) if n]
            for t, d, info in plans[i]:
                if t.kind == "live":
                    update.touched.add(info.name)
                    slot = update._slot(d.live)
                    cols, regions, pos = live.setdefault(size, ([], [], []))
                    for p, s, n, v in parts:
                        cols.append([d.ptr, (bptr if p is sp.bpos else iptr) + 8 * s, base + v, n, t.dst_offset, slot])
                        regions.append(d.region)
                        pos.append((p, s))
                else:
                    update.begin_requantize(info, d)
                    update.mark_whole(info, t, d)
                    dst = d.base_int.data_ptr()
                    for p, s, n, v in parts:
                        copies.setdefault(size, []).append(
                            [dst, (bptr if p is sp.bpos else iptr) + 8 * s, base + v, n, t.dst_offset, 0])
            update.num_in_place += 1
    for size, cols_ in copies.items():
        a = np.array(cols_, dtype=np.int64)
        scatter_rows(call.buf.view(_INT[size]), a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4])
    for size, (cols, regions, pos) in live.items():
        a = np.array(cols, dtype=np.int64)
        old = torch.empty(int(a[:, 3].sum()), dtype=_INT[size], device=call.buf.device)
        sums = update._sum_slots[call.buf.device]  # after every _slot(): it may have grown
        scatter_rows(call.buf.view(_INT[size]), a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], slots=a[:, 5],
                     old=old, sums=sums)
        if update.session.rollback:
            update._element_snaps.append(FlatSnap(regions, pos, a[:, 3].tolist(), old))
