"""Host storage of streamed blocks and the one operation the streamer needs: copy a block to the device.

Four stores, chosen by how the host weights were loaded (``weight_sync.offload.host_weights``):

* :class:`PackedStore` - a private pinned arena holding every block packed in slot layout (one H2D copy
  per block); with AllGather it holds only this rank's 1/group shard of each block.
* :class:`InPlaceStore` - mmap'd checkpoint tensors pinned in place (read-only, under a budget); each
  tensor is copied straight from the shared page cache into its slot offset.
* :class:`StagedStore` - pageable host tensors (an mmap that could not be pinned, the runtime cache)
  packed per request through two bounded pinned staging buffers.

``copy_block`` runs on the submission thread with the copy stream current; it only *enqueues* device
copies (on CPU they complete immediately).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from weight_sync.errors import ConfigError
from weight_sync.layers import DeviceShim
from weight_sync.offload.layout import BlockLayout, pack_block
from weight_sync.offload.pinned import InPlacePins, PinnedRegion, register_region

__all__ = [
    "HostStore",
    "InPlaceStore",
    "PackedStore",
    "StagedStore",
]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class HostStore(abc.ABC):
    """Where the host bytes of every block live; subclasses implement ``copy_block``."""

    kind = "abstract"

    def __init__(self) -> None:
        self.host_bytes = 0  # host bytes this rank holds for block weights (private or mapped)
        self.mapped_bytes = 0  # the part of host_bytes that is a shared file mapping
        self.pinned_bytes = 0  # page-locked bytes (registered; accounted on CPU too)

    @abc.abstractmethod
    def copy_block(self, index: int, dst: torch.Tensor) -> int:
        """Enqueue the copy of block ``index``'s bytes (or this rank's shard) into ``dst``; return bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release pinned registrations (before the memory behind them goes away)."""


class PackedStore(HostStore):
    """Every block packed into one private host arena, pinned unless pinning failed or was refused.

    With ``shard=(rank, group_size)`` only bytes ``[rank * S, (rank + 1) * S)`` of each zero-padded block
    are kept (S = ``layout.shard_bytes``): host memory per rank is 1/group of the blocks.
    """

    kind = "packed"

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Sequence[Sequence[torch.Tensor]] | None,
        *,
        arena: torch.Tensor,
        region: PinnedRegion | None,
        alignment: int,
        shard: tuple[int, int] | None = None,
    ) -> None:
        """``sources`` None: ``arena`` already holds every block packed at ``arena_plan``'s offsets."""
        super().__init__()
        self.arena, self.region = arena, region
        self.shard = shard
        self.offsets, self.sizes = self.arena_plan(layouts, alignment=alignment, shard=shard)
        self.host_bytes = sum(self.sizes)
        self.pinned_bytes = region.nbytes if region is not None else 0
        if sources is None:
            return
        # Pack through one scratch block: with sharding, only this rank's chunk of it is kept.
        scratch = None
        if shard is not None:
            scratch = torch.empty(max(lay.padded_bytes for lay in layouts), dtype=torch.uint8)
        for lay, srcs, off, size in zip(layouts, sources, self.offsets, self.sizes):
            if shard is None:
                pack_block(lay, arena[off : off + size], srcs)
            else:
                assert scratch is not None
                rank, _ = shard
                pack_block(lay, scratch[: lay.padded_bytes], srcs)
                arena[off : off + size].copy_(scratch[rank * size : (rank + 1) * size])

    @staticmethod
    def arena_plan(
        layouts: Sequence[BlockLayout], *, alignment: int, shard: tuple[int, int] | None
    ) -> tuple[list[int], list[int]]:
        """Offsets and sizes of each block (or shard) in the arena; the arena size is the last end."""
        offsets, sizes, end = [], [], 0
        for lay in layouts:
            size = lay.shard_bytes if shard is not None else lay.nbytes
            end = _align(end, alignment)
            offsets.append(end)
            sizes.append(size)
            end += size
        return offsets, sizes

    def block_bytes(self, index: int) -> torch.Tensor:
        """Block ``index``'s bytes in the arena (with AllGather: this rank's shard of it), as a view."""
        off, size = self.offsets[index], self.sizes[index]
        return self.arena[off : off + size]

    def copy_block(self, index: int, dst: torch.Tensor) -> int:
        off, size = self.offsets[index], self.sizes[index]
        dst[:size].copy_(self.arena[off : off + size], non_blocking=True)
        return size

    def close(self) -> None:
        if self.region is not None:
            self.region.unregister()
            self.region = None
        self.pinned_bytes = 0


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


class InPlaceStore(HostStore):
    """Block tensors read straight from read-only mmaps that are pinned in place (no private copy)."""

    kind = "pinned_in_place"

    def __init__(
        self, layouts: Sequence[BlockLayout], sources: Sequence[Sequence[torch.Tensor]], pins: InPlacePins
    ) -> None:
        super().__init__()
        if not pins.active:
            raise ConfigError(f"InPlaceStore needs active pins, got: {pins.reason or 'none'}")
        self.pins = pins
        self.copies: list[list[tuple[int, torch.Tensor]]] = []
        for lay, srcs in zip(layouts, sources):
            plan = []
            for p, src in zip(lay.placements, srcs, strict=True):
                if not src.is_contiguous() or p.span_bytes != src.numel() * src.element_size():
                    raise ConfigError(
                        f"{p.name}: a mapped tensor must be contiguous to be copied in place, got "
                        f"stride {tuple(src.stride())} for shape {tuple(src.shape)}"
                    )
                if p.span_bytes:
                    plan.append((p.offset, _as_bytes(src)))
            self.copies.append(plan)
        self.host_bytes = self.mapped_bytes = sum(
            src.numel() * src.element_size() for srcs in sources for src in srcs
        )
        self.pinned_bytes = pins.pinned_bytes

    def copy_block(self, index: int, dst: torch.Tensor) -> int:
        total = 0
        for offset, src in self.copies[index]:
            dst[offset : offset + src.numel()].copy_(src, non_blocking=True)
            total += src.numel()
        return total

    def close(self) -> None:
        self.pins.release()
        self.pinned_bytes = 0


class StagedStore(HostStore):
    """Pageable block tensors packed per request through two bounded pinned staging buffers.

    Pageable memory cannot feed an asynchronous H2D copy, so each block is first packed (a host memcpy
    on the submission thread) into staging buffer k, then copied to the device from there. Before
    buffer k is packed again, the submission thread waits for the H2D that last read it: that CPU wait
    happens off the compute thread, bounded by the previous copy of the same buffer.
    """

    kind = "staged"

    def __init__(
        self,
        layouts: Sequence[BlockLayout],
        sources: Sequence[Sequence[torch.Tensor]],
        *,
        shim: DeviceShim,
        pinned: bool,
        mapped: bool,
        mapped_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.layouts, self.sources = list(layouts), [list(s) for s in sources]
        size = max(lay.nbytes for lay in layouts)
        self.staging = [torch.zeros(max(size, 1), dtype=torch.uint8) for _ in range(2)]
        self.regions: list[PinnedRegion] = []
        self.pin_error = ""
        if pinned:
            try:
                self.regions = [register_region(s, device=shim.device) for s in self.staging]
            except Exception as e:  # PinError or a driver error: stage through pageable buffers
                for r in self.regions:
                    r.unregister()
                self.regions = []
                self.pin_error = str(e)
        self.done = [shim.event(), shim.event()]  # allocated once: "H2D out of staging k finished"
        self._next = 0
        source_bytes = sum(s.numel() * s.element_size() for srcs in self.sources for s in srcs)
        # ``mapped_bytes`` overrides the count when only some sources are mapped (quantized blocks: the
        # processor's output is private, the unprocessed biases may still be views of the mapping).
        self.mapped_bytes = (source_bytes if mapped else 0) if mapped_bytes is None else mapped_bytes
        self.host_bytes = source_bytes + 2 * size
        self.pinned_bytes = sum(r.nbytes for r in self.regions)

    def copy_block(self, index: int, dst: torch.Tensor) -> int:
        k = self._next
        self._next ^= 1
        # The H2D that last read staging[k] was enqueued two blocks ago; it must finish before the host
        # overwrites the buffer, or the device would receive a mix of two blocks.
        self.done[k].synchronize()
        lay = self.layouts[index]
        staging = self.staging[k]
        pack_block(lay, staging[: lay.nbytes], self.sources[index], zero=False)
        dst[: lay.nbytes].copy_(staging[: lay.nbytes], non_blocking=True)
        self.done[k].record()
        return lay.nbytes

    def close(self) -> None:
        for ev in self.done:
            ev.synchronize()
        for r in self.regions:
            r.unregister()
        self.regions = []
        self.pinned_bytes = 0
