"""The AllGather group: which ranks hold the same weights, its dedicated communicator, and agreement.

Ranks are laid out ``rank = ((dp_index * usp) + sp_index) * tp + tp_index``. The gather group is the DP
group (same SP and TP coordinates) when dp > 1, else the SP group (same TP coordinate) when usp > 1:
ranks that hold identical weights. TP ranks hold different shards and never gather from each other.

Weight gathers run on a communicator created here for that purpose only (``dist.new_group``), never the
one activation collectives use: two threads issuing collectives on one NCCL communicator in different
orders deadlock. Before the first gather, ranks compare a digest of their transfer schedule, and
decisions that change the schedule (a rank could not pin memory) are taken by an all-rank vote.

Agreement during inference (``weight_sync.offload.call_guard``) runs on a third group, gloo over the
same ranks: the compute thread exchanges a few bytes there while the submission thread is inside a
weight gather, and two threads must never share one communicator. Its waits are bounded by
``transfer_timeout_s`` (the gloo group's own timeout), so a peer that never joins raises instead of
hanging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from weight_sync.errors import ConfigError, TransportError, TransportTimeout
from weight_sync.offload.config import OffloadConfig

__all__ = [
    "GatherGroup",
    "all_gather_bytes",
    "build_gather_group",
    "gather_group_ranks",
]

logger = logging.getLogger(__name__)


@dataclass
class GatherGroup:
    """This rank's gather group: ``size`` 1 means no collective at all."""

    size: int
    rank: int  # index within the group (which shard this rank keeps)
    global_rank: int
    group: Any = None  # torch.distributed ProcessGroup, None when size == 1
    control_device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # agreement tensors
    members: tuple[int, ...] = ()  # global ranks of the group, in group order
    # gloo group over the same ranks for agreement while transfers run (compute thread only), and the
    # bound on each of its waits.
    control_group: Any = None
    control_timeout_s: float = 600.0

    @property
    def active(self) -> bool:
        return self.size > 1

    def _log_prefix(self) -> str:
        return f"[rank {self.global_rank}]"

    def check_same_schedule(self, digest: bytes) -> None:
        """Raise on *every* rank if any member's schedule digest differs from the others'."""
        if not self.active:
            return
        import torch.distributed as dist

        mine = torch.tensor(list(digest), dtype=torch.uint8, device=self.control_device)
        everyone = torch.empty(self.size * mine.numel(), dtype=torch.uint8, device=self.control_device)
        all_gather_bytes(everyone, mine, self.group)
        digests = [bytes(everyone[i * 32 : (i + 1) * 32].tolist()).hex()[:12] for i in range(self.size)]
        if len(set(digests)) != 1:
            members = dist.get_process_group_ranks(self.group)
            shown = ", ".join(f"rank {r}: {d}" for r, d in zip(members, digests))
            raise ConfigError(
                f"{self._log_prefix()} the DLO transfer schedule differs across the gather group "
                f"({shown}); every rank of a gather group must build the same model (block names, "
                "shapes, dtypes, strides) with the same offload config before the first AllGather"
            )

    def exchange_fixed(self, data: bytes, *, what: str) -> list[bytes]:
        """Every member's ``data`` (the same length on all), in group order, over the control group.

        Bounded: gloo gives up after ``control_timeout_s`` when a peer does not join; that (or a lost
        peer) raises ``TransportTimeout`` / ``TransportError`` naming ``what`` and the group.
        """
        if not self.active:
            return [data]
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        everyone = torch.empty(self.size * len(data), dtype=torch.uint8)
        try:
            all_gather_bytes(everyone, mine, self.control_group)
        except RuntimeError as e:
            timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
            cls = TransportTimeout if timed_out else TransportError
            raise cls(
                f"{self._log_prefix()} {what}: the gather group (ranks {list(self.members)}) did not all "
                f"join within {self.control_timeout_s:g} s (transfer_timeout_s); a peer did not make "
                f"the same call, or stopped: {e}"
            ) from e
        raw = everyone.numpy().tobytes()
        n = len(data)
        return [raw[i * n : (i + 1) * n] for i in range(self.size)]

    def all_agree(self, ok: bool) -> bool:
        """All-rank vote: True only if ``ok`` holds on every member (a MIN all-reduce)."""
        if not self.active:
            return ok
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=self.control_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


def all_gather_bytes(out: torch.Tensor, inp: torch.Tensor, group: Any, *, async_op: bool = False) -> Any:
    """``all_gather_into_tensor`` (named ``all_gather_single`` in newer torch) on ``group``."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def gather_group_ranks(config: OffloadConfig) -> list[list[int]]:
    """Every gather group of the world the config describes, in a fixed order (all ranks agree)."""
    dp, usp, tp = config.data_parallel_size, config.usp, config.tensor_parallel_size
    if dp > 1:
        return [[(d * usp + s) * tp + t for d in range(dp)] for s in range(usp) for t in range(tp)]
    if usp > 1:
        return [[s * tp + t for s in range(usp)] for t in range(tp)]
    return [[r] for r in range(tp)]


def build_gather_group(config: OffloadConfig, device: torch.device) -> GatherGroup:
    """Create (collectively, on every rank) the dedicated gather communicators and return this rank's."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    global_rank = dist.get_rank() if initialized else 0
    if not config.allgather_active:
        return GatherGroup(1, 0, global_rank)
    if not initialized:
        raise ConfigError(
            f"DLO AllGather over a group of {config.gather_group_size} needs torch.distributed "
            "initialized (one process per rank), but no default process group exists; initialize it "
            "or pass --dlo-no-use-allgather"
        )
    world = dist.get_world_size()
    if world != config.world_size:
        raise ConfigError(
            f"data_parallel_size={config.data_parallel_size} x usp={config.usp} x "
            f"tensor_parallel_size={config.tensor_parallel_size} = {config.world_size} ranks, "
            f"but the default process group has {world}"
        )
    options = None
    if "nccl" in str(dist.get_backend()).lower():
        # The gather runs next to compute kernels that fill every SM; on a normal-priority stream its
        # kernel waits for their blocks to drain. A high-priority stream gets the next free SMs first.
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = True
    control_timeout = timedelta(seconds=config.transfer_timeout_s)
    mine = None
    for ranks in gather_group_ranks(config):
        # new_group is collective over the default group: every rank creates every group, in order.
        group = dist.new_group(ranks, pg_options=options)
        agreement = dist.new_group(ranks, backend="gloo", timeout=control_timeout)
        if global_rank in ranks:
            mine = (group, agreement, ranks)
    assert mine is not None  # every rank is in exactly one group by construction
    group, agreement, ranks = mine
    backend = str(dist.get_backend(group)).lower()
    control = device if "nccl" in backend else torch.device("cpu")
    logger.info("[rank %d] DLO gather group %s (%s)", global_rank, ranks, backend)
    return GatherGroup(
        len(ranks), ranks.index(global_rank), global_rank, group, control, members=tuple(ranks),
        control_group=agreement, control_timeout_s=config.transfer_timeout_s,
    )
