"""FSDP2 / DTensor source: gather one block at a time on every rank, send from one rank (or, with
:meth:`FSDPSource.shards`, send every rank's own pieces over the sharded data plane).

Every trainer rank iterates the source in lockstep: for each block, all ranks call ``full_tensor()`` on
the block's sharded parameters (an all-gather each, in the same order everywhere), then all ranks agree
through a one-element all-reduce that the sending rank is still consuming; only the sending rank yields
the tensors, the others drop them. A rank never holds more than one block of gathered tensors (the block
is gathered completely before the agreement, so a failure can never strand the others mid-block). If the
sending rank's consumer stops (the transport failed), its generator gathers the block the others are
already gathering and reports the abort in the next agreement; every other rank raises SourceError
instead of waiting in a collective. Every agreement has a deadline (``agree_timeout_s``): a rank that never
arrives (it died, hung, or stopped iterating without telling) makes the others raise ``TransportTimeout``
naming the agreement; the group then holds an unmatched collective, so the source does no further
collective (no cleanup gather) and the trainer's group must be rebuilt.

Usage, on every rank::

    source = FSDPSource(model)                       # after fully_shard(...)
    if dist.get_rank() == 0:
        sender.update_weights(source)                # rank 0 owns the WeightSender
    else:
        source.participate()
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainers.names import NameMap
from trainers.sources import ModuleSource, SourceEntry
from weight_sync.errors import SourceError, TransportTimeout
from weight_sync.layers import group_by_block
from weight_sync.manifest import Manifest
from weight_sync.transport.group import Deadline, poll, wait_gloo
from weight_sync.transport.routes import Holding

__all__ = ["FSDPSource"]


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


class FSDPSource(ModuleSource):
    """A :class:`ModuleSource` over a model whose parameters are DTensors (FSDP2 ``fully_shard``).

    group: the process group the shards live on (default: the default group). src_rank: the group rank
    that yields (owns the sender). agree_timeout_s: how long a rank waits in an agreement for the others
    (a rank that never arrives - dead, hung, or no longer iterating - is a ``TransportTimeout`` naming
    the agreement, not a hang; the group then holds an unmatched collective and cannot be trusted).
    ``peak_live_bytes`` records the most gathered bytes the source ever had alive at once on this rank.
    """

    def __init__(
        self,
        model: nn.Module,
        name_map: NameMap | None = None,
        *,
        dtype: torch.dtype | None = None,
        group: Any = None,
        src_rank: int = 0,
        agree_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(model, name_map, dtype=dtype)
        if not agree_timeout_s > 0:
            raise ValueError(f"agree_timeout_s must be > 0, got {agree_timeout_s!r}")
        self.group = group
        self.src_rank = src_rank
        self.agree_timeout_s = float(agree_timeout_s)
        self._timed_out = False  # an agreement timed out: the group holds an unmatched collective
        self.peak_live_bytes = 0
        self._live_bytes = 0
        names = [e.name for e in self.entries]
        by_name = {e.name: e for e in self.entries}
        self.blocks: list[list[SourceEntry]] = [
            [by_name[n] for n in block] for block in group_by_block(names, reference_order=names).values()
        ]
        self.largest_block_bytes = max(
            (sum(e.tensor.numel() * self._dtype(e.tensor).itemsize for e in b) for b in self.blocks), default=0
        )

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor().detach() if _is_dtensor(t) else t.detach()

    def shards(self, version: Any = None) -> tuple[list[Holding], dict[str, torch.Tensor], Manifest]:
        """This rank's part of a sharded update (no collective): (holdings, local pieces, manifest).

        Holdings come from the DTensor placements (the same on every rank; plain tensors are held whole by
        every rank of the group), local pieces are ``to_local()`` views cast to the wire dtype (a copy
        only when the dtype changes), the manifest lists global shapes in block order. Pass them to
        :meth:`weight_sync.transport.ShardedSender.send` on every trainer rank at once. LoRA factors are
        not merged here (a merge needs the whole tensor): a source with factors is refused.
        """
        from weight_sync.transport.routes_layouts import holdings_from_dtensors

        merged = [e.name for e in self.entries if e.factors]
        if merged:
            raise SourceError(f"{merged[0]}: LoRA factors are merged into whole tensors; a sharded update sends "
                              "pieces (merge the adapters into the base weights first)")
        group_ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
        holdings = holdings_from_dtensors(((e.name, e.tensor) for e in self.entries), plain_ranks=group_ranks)
        local = {}
        for i, (e, h) in enumerate(zip(self.entries, holdings)):
            t = e.tensor.detach()
            piece = t.to_local() if _is_dtensor(t) else t
            dtype = self._dtype(e.tensor)
            local[e.name] = piece if piece.dtype == dtype else piece.to(dtype)
            if h.dtype != dtype:  # the wire dtype (a cast source): same boxes
                holdings[i] = Holding(name=h.name, shape=h.shape, dtype=dtype, pieces=h.pieces)
        return holdings, local, self.manifest(version)

    def _track(self, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        self._live_bytes += n
        self.peak_live_bytes = max(self.peak_live_bytes, self._live_bytes)

        def release(nbytes: int = n) -> None:
            self._live_bytes -= nbytes

        weakref.finalize(t, release)

    def _agree(self, abort: bool, where: str) -> None:
        backend = dist.get_backend(self.group)
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        flag = torch.tensor([1 if abort else 0], dtype=torch.int64, device=device)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait_agreement(work, where)
        if int(flag.item()) and not abort:
            raise SourceError(
                f"[rank {dist.get_rank()}] the sending rank {self.src_rank} stopped consuming weights {where}; "
                "every trainer rank stops the gather"
            )

    def _wait_agreement(self, work: Any, where: str) -> None:
        """Wait for the agreement's all-reduce with this source's deadline (the group's own timeout is
        typically 30 minutes or more, and NCCL's may tear the process down)."""
        deadline = Deadline(self.agree_timeout_s)

        def timed_out() -> BaseException:
            self._timed_out = True
            size = dist.get_world_size(self.group)
            return TransportTimeout(
                f"[rank {dist.get_rank()}] FSDPSource agreement {where}: expected all {size} trainer ranks "
                f"within {self.agree_timeout_s:.1f} s, some never arrived (dead, hung, or no longer "
                "iterating the source)"
            )

        if dist.get_backend(self.group) == "gloo":
            wait_gloo(work, deadline, timed_out)
        else:
            poll(work.is_completed, deadline, timed_out)
        work.wait()  # the result (or the collective's own error); NCCL: orders the flag's stream

    def _gather(self, block: list[SourceEntry]) -> list[tuple[str, torch.Tensor]]:
        out = []
        with torch.no_grad():
            for e in block:
                t = self.produce(e)
                self._track(t)
                out.append((e.name, t))
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        sending = dist.get_rank(self.group) == self.src_rank
        self._started = True
        b = 0
        finished = False
        try:
            for b in range(len(self.blocks)):
                block = self.blocks[b]
                gathered = self._gather(block)
                self._agree(False, f"before block {block[0].name}")
                if not sending:
                    gathered.clear()
                    continue
                while gathered:
                    name, t = gathered.pop(0)
                    yield name, t
                    del t
            self._agree(False, "after the last block")
            finished = True
        finally:
            if sending and not finished and not self._timed_out:
                # The consumer stopped while we were yielding block b: the others are gathering block
                # b+1 (or waiting in the final agreement); join them, then tell them to stop.
                if b + 1 < len(self.blocks):
                    self._gather(self.blocks[b + 1]).clear()
                self._agree(True, "mid-update")

    def abort(self) -> None:
        """On the sending rank, when the transport failed before this source was iterated at all: join the
        other ranks' first gather and tell them to stop (an iteration in progress does this itself)."""
        if getattr(self, "_started", False) or not self.blocks:
            return
        self._started = True
        self._gather(self.blocks[0]).clear()
        self._agree(True, "before the first block")

    def participate(self) -> None:
        """Run this rank's part of the lockstep gather (ranks that do not send)."""
        for _ in self:
            raise AssertionError("a non-sending rank must not yield tensors")
