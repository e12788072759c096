"""Block layout: where each tensor of a block lives inside a flat byte slot, and the schedule digest.

Every streamed block is packed into one flat uint8 region: tensors in module order, each at an offset
aligned to ``alignment`` bytes, laid out with its own strides (a transposed fp8 weight stays transposed).
One flat byte region per block means one H2D copy and, with AllGather, one collective per block (the
reference flattened per dtype and paid one collective per dtype). The packed size is zero-padded to a
multiple of ``group_size * alignment`` so each rank's shard is equal and aligned.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.layers import strided_view

__all__ = [
    "BlockLayout",
    "TensorPlacement",
    "layout_block",
    "pack_block",
    "schedule_digest",
    "slot_views",
]


@dataclass(frozen=True, eq=False)
class TensorPlacement:
    """One tensor of a block: the live object to re-point and its place in the block's bytes."""

    name: str  # qualified name, e.g. "transformer.blocks.3.attn.qkv.weight"
    kind: Literal["parameter", "buffer"]
    tensor: torch.Tensor  # the live Parameter / buffer object; re-pointed, never replaced
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # byte offset inside the block region
    span_bytes: int  # bytes the strided layout covers

    def view(self, base: torch.Tensor, base_offset: int = 0) -> torch.Tensor:
        """This tensor's strided view into the flat uint8 ``base`` starting at ``base_offset``."""
        return strided_view(
            base, shape=self.shape, stride=self.stride, dtype=self.dtype,
            byte_offset=base_offset + self.offset,
        )


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """The packed layout of one streamed block."""

    index: int  # position in the global stream order
    name: str
    placements: tuple[TensorPlacement, ...]
    nbytes: int  # end of the last tensor
    padded_bytes: int  # nbytes rounded up to a multiple of group_size * alignment
    group_size: int

    @property
    def shard_bytes(self) -> int:
        return self.padded_bytes // self.group_size

    def describe(self) -> list[object]:
        """JSON-ready description (names, dtypes, shapes, strides, offsets): what the digest covers."""
        return [
            self.name, self.nbytes, self.padded_bytes,
            [[p.name, str(p.dtype), list(p.shape), list(p.stride), p.offset] for p in self.placements],
        ]


def _span_bytes(shape: tuple[int, ...], stride: tuple[int, ...], elem: int) -> int:
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * elem


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def layout_block(
    index: int, name: str, block: nn.Module, *, alignment: int, group_size: int,
    order: Sequence[str] | None = None,
) -> BlockLayout:
    """Lay out every parameter and buffer of ``block`` (tied tensors once) in a flat aligned region.

    ``order`` (qualified names) overrides module order, e.g. to follow a checkpoint file's order.
    """
    entries: list[tuple[str, Literal["parameter", "buffer"], torch.Tensor]] = []
    seen: set[int] = set()
    for sub_name, sub in block.named_modules():
        for kind, table in (("parameter", sub._parameters), ("buffer", sub._buffers)):
            for t_name, t in table.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                qual = ".".join(x for x in (name, sub_name, t_name) if x)
                if t.device.type == "meta":
                    raise ConfigError(f"{qual}: tensor is on the meta device; load weights before offload")
                if t.is_sparse or t.layout != torch.strided:
                    raise ConfigError(f"{qual}: only strided dense tensors can stream, got {t.layout}")
                entries.append((qual, kind, t))  # type: ignore[arg-type]
    if order is not None:
        rank = {n: i for i, n in enumerate(order)}
        entries.sort(key=lambda e: rank.get(e[0], len(rank)))
    placements = []
    offset = 0
    for qual, kind, t in entries:
        elem = t.element_size()
        span = _span_bytes(tuple(t.shape), tuple(t.stride()), elem)
        offset = _align(offset, alignment)
        placements.append(
            TensorPlacement(qual, kind, t, t.dtype, tuple(t.shape), tuple(t.stride()), offset, span)
        )
        offset += span
    padded = _align(max(offset, 1), alignment * group_size)
    return BlockLayout(index, name, tuple(placements), offset, padded, group_size)


def pack_block(
    layout: BlockLayout, dst: torch.Tensor, sources: Sequence[torch.Tensor], *, zero: bool = True
) -> None:
    """Write ``sources`` (one per placement) into the flat uint8 ``dst`` at their placements.

    ``zero`` clears ``dst`` first so padding and stride gaps are deterministic (every rank packs equal
    bytes); per-request staging skips it because no kernel ever reads those gaps.
    """
    if zero:
        dst.zero_()
    for p, src in zip(layout.placements, sources, strict=True):
        p.view(dst).copy_(src)


def slot_views(layout: BlockLayout, slot: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Views of every tensor of ``layout`` into ``slot`` (made once, re-used on every load)."""
    return tuple(p.view(slot) for p in layout.placements)


def schedule_digest(layouts: Sequence[BlockLayout], rings: Sequence[Sequence[int]], *,
                    group_size: int, alignment: int, landing_buffers: bool = False,
                    quantization: str | None = None) -> bytes:
    """SHA-256 of the transfer schedule: ring order, block layouts, group size, alignment, landing mode.

    Ranks of one gather group must issue identical collectives on identically sized buffers; two ranks
    whose digests differ would hang or corrupt each other's blocks in the first AllGather. The landing
    mode (in-place gather into the slot, or out of place from a landing buffer) does not change the
    collective's sizes, but it changes when each rank's gather can start; the group runs one schedule,
    so ranks that disagree on it fail here too. ``quantization`` (the linear method's name) is covered
    too: dtypes and shapes tell most schemes apart, but not all of them.
    """
    doc = {
        "group_size": group_size,
        "alignment": alignment,
        "landing_buffers": landing_buffers,
        **({"quantization": quantization} if quantization is not None else {}),
        "rings": [list(r) for r in rings],
        "blocks": [layout.describe() for layout in layouts],
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).digest()
