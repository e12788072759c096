"""Regions into an open update session: the sharded receiver's last step before the kernel tensors.

A sharded engine rank never holds a whole checkpoint tensor: it receives boxes of them, each with the
destination view its reload plan recorded (see :func:`~weight_sync.transport.routes_layouts.needs_from_model`).
:class:`RegionSink` writes each box straight into that view of the session's target - the live
parameter of a direct layer, the model-format staging of a processed layer (which holds only this
rank's shard), a unit's staging for layers processed expert by expert - and, once every box of a key
has been written, completes the key as the session's own replay of a whole tensor would (a processed
layer whose last key arrived is processed then). Keys the engine loads through a computing loader
(``param=None``) are the exception: their whole tensor is staged here and given to ``session.load``.

This is the session's replay step split per region: it uses the session's layer-preparation, target
and completion steps (the ones ``UpdateSession.load`` runs per whole tensor), so snapshots for
rollback, staging under the budget and the pointer audit at finish are the session's own.
"""

from __future__ import annotations

from typing import Any

import torch

from weight_sync.errors import LayoutMismatchError, UpdateStateError
from weight_sync.reload.plan import CopyOp, contiguous_strides
from weight_sync.transport.routes import Box, Need

__all__ = ["RegionSink"]


def _volume(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= max(0, b - a)
    return n


class RegionSink:
    """Writes received regions of checkpoint tensors into an open :class:`~weight_sync.reload.UpdateSession`.

    needs: this engine rank's needs (its pieces say how many elements of each key it will receive).
    """

    def __init__(self, session: Any, needs: list[Need], rank: int) -> None:
        from weight_sync.reload.session import UpdateSession

        if not isinstance(session, UpdateSession):
            raise UpdateStateError(f"[engine rank {rank}] a sharded update writes into an UpdateSession, "
                                   f"got {type(session).__name__}")
        self.session = session
        self.rank = rank
        self._left = {n.name: sum(_volume(p.box) for p in n.pieces if p.rank == rank) for n in needs}
        self._whole: dict[str, torch.Tensor] = {}  # loader keys: their tensor, staged whole
        self._shapes = {n.name: n.shape for n in needs}
        self.region_bytes = 0

    def write(self, name: str, param: str | None, dst_offset: int, dst_stride: tuple[int, ...],
              box: Box, src: torch.Tensor) -> None:
        """Write ``src`` (region ``box`` of key ``name``, shaped like the box) into the planned view."""
        left = self._left.get(name)
        if left is None:
            raise LayoutMismatchError(f"[engine rank {self.rank}] {name}: a region arrived for a key this "
                                      "rank does not need")
        n = src.numel()
        if n > left:
            raise LayoutMismatchError(f"[engine rank {self.rank}] {name}: {n} more elements arrived than the "
                                      f"{left} this rank still needs of it")
        s = self.session
        s._require_open()
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # parameters may require grad; these writes are not autograd ops
        try:
            if param is None:
                whole = self._whole.get(name)
                if whole is None:
                    whole = self._whole[name] = torch.empty(self._shapes[name], dtype=src.dtype, device=s.device)
                whole[tuple(slice(a, b) for a, b in box)].copy_(src)
            else:
                self._write_view(name, param, dst_offset, dst_stride, src)
        finally:
            torch._C._set_grad_enabled(grad)
        self.region_bytes += src.nbytes
        s.count_received(src.nbytes)  # the update's bytes: what this rank received, not whole keys
        self._left[name] = left - n
        if left == n:
            self._key_done(name)

    def _write_view(self, name: str, param: str, dst_offset: int, dst_stride: tuple[int, ...],
                    src: torch.Tensor) -> None:
        layer, _, tensor = param.rpartition(".")
        size = tuple(src.shape)
        op = CopyOp(layer=layer, tensor=tensor, dst_offset=dst_offset, dst_size=size, dst_stride=dst_stride,
                    src_offset=0, src_size=size, src_stride=contiguous_strides(size), src_whole=True)
        try:
            self.session.write_region(name, op, src)
        except LayoutMismatchError as e:
            raise LayoutMismatchError(f"[engine rank {self.rank}] {e}") from None

    def _key_done(self, name: str) -> None:
        """Every region of ``name`` is written: complete it (and any layer it was the last key of)."""
        whole = self._whole.pop(name, None)
        if whole is not None:
            self.session.load([(name, whole)])  # the engine's own loader consumes the whole tensor
            return
        self.session.complete_regions(name)

    def incomplete(self) -> list[str]:
        """Keys with regions still to come on this rank."""
        return sorted(n for n, left in self._left.items() if left)
