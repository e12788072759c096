"""Expert-parallel trainer sources: each rank sends its own whole experts, never another rank's.

An expert-parallel (EP) trainer splits every MoE layer's experts over ``ep_size`` ranks: rank r holds
experts ``r*E/ep_size .. (r+1)*E/ep_size - 1`` whole, and every rank holds the replicated tensors
(attention, norms, routers, embeddings). Gathering the experts onto one sending rank would move every
expert twice and hold a whole layer's experts on that rank; instead each rank sends its part:

- rank r: the HF-named expert tensors ``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``
  of its own experts ``e`` (global ids), in block order;
- the replicated tensors once, from ``replicated_rank`` (rank 0 by default).

Each rank drives its own ``WeightSender`` with its :class:`ExpertParallelSource`; the engine receives
the parts into one transaction with :class:`weight_sync.transport.joined.JoinedUpdate` (one receiver
per trainer rank). No collective runs between trainer ranks.

Two trainer layouts of a rank's experts are understood, both numbered locally from 0:

- per-expert modules (``experts.{j}.gate_proj.weight``...): :func:`expert_name_map` renames them to
  global ids (``j + ep_rank * num_local_experts``);
- stacked, as transformers 5 holds them (``experts.gate_up_proj [E_local, 2I, H]``, gate rows first,
  and ``experts.down_proj [E_local, H, I]``): split by every :class:`ModuleSource` into the per-expert
  HF names as views (no copy, see :func:`trainers.sources.split_stacked_experts`), ids from
  ``expert_offset``.

Limitations: no LoRA on
stacked experts; no DTensor experts (an FSDP2-sharded stacked tensor would be gathered whole per
expert: use per-expert modules or ``to_local()`` tensors of whole experts).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from trainers.names import NameMap
from trainers.sources import ModuleSource
from weight_sync.errors import ConfigError

__all__ = ["EXPERT_NAME", "ExpertParallelSource", "expert_id", "expert_name_map"]

#: An HF expert tensor name: ``...mlp.experts.{e}.{gate,up,down}_proj.weight``.
EXPERT_NAME = re.compile(r"^(?P<pre>.*\.mlp\.experts\.)(?P<e>\d+)(?P<post>\.(?:gate|up|down)_proj\.weight)$")


def expert_id(name: str) -> int | None:
    """The expert id in an HF expert tensor name, or None for any other tensor."""
    m = EXPERT_NAME.match(name)
    return None if m is None else int(m.group("e"))


def expert_name_map(*, ep_rank: int, num_local_experts: int, base: NameMap | None = None) -> NameMap:
    """Rename local expert ids to global ones: ``experts.{j}`` -> ``experts.{ep_rank*num_local_experts+j}``.

    ``base`` maps the trainer's names to HF names first (default: the identity); other names pass
    through it unchanged. A local id ``>= num_local_experts`` is unmapped (reported with the others).
    """
    if ep_rank < 0 or num_local_experts < 1:
        raise ConfigError(f"ep_rank must be >= 0 and num_local_experts >= 1, got {ep_rank}, {num_local_experts}")
    base = base or NameMap()
    offset = ep_rank * num_local_experts

    def rename(name: str) -> str | None:
        hf = base(name)
        if hf is None:
            return None
        m = EXPERT_NAME.match(hf)
        if m is None:
            return hf
        local = int(m.group("e"))
        if local >= num_local_experts:
            raise KeyError(name)
        return f"{m.group('pre')}{local + offset}{m.group('post')}"

    return NameMap(rename)


class ExpertParallelSource(ModuleSource):
    """What one EP trainer rank sends: its own experts, plus the replicated tensors on one rank.

    model: this rank's module (its local experts and the replicated tensors). ep_rank / ep_size: this
    rank's place in the EP group; num_experts: experts per MoE layer, globally. local_ids: the model
    numbers its experts from 0 on every rank (renamed with :func:`expert_name_map`); False: its names
    carry global ids already. replicated_rank: the rank that sends the non-expert tensors. name_map:
    trainer -> HF names, applied before the expert renaming. dtype: cast floating tensors on the fly.

    Refused at construction (``ConfigError`` naming the tensor): an expert outside this rank's range,
    and a layer that lacks one of this rank's experts or one of its projections.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        local_ids: bool = True,
        replicated_rank: int = 0,
        name_map: NameMap | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if not 0 <= ep_rank < ep_size:
            raise ConfigError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
        if num_experts % ep_size:
            raise ConfigError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if not 0 <= replicated_rank < ep_size:
            raise ConfigError(f"replicated_rank must be in [0, {ep_size}), got {replicated_rank}")
        self.ep_rank, self.ep_size, self.num_experts = ep_rank, ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_ids = range(ep_rank * self.num_local_experts, (ep_rank + 1) * self.num_local_experts)
        if local_ids:
            name_map = expert_name_map(ep_rank=ep_rank, num_local_experts=self.num_local_experts, base=name_map)
        super().__init__(model, name_map, dtype=dtype, expert_offset=self.expert_ids.start)
        self.sends_replicated = ep_rank == replicated_rank
        self._check_experts()
        self.entries = [e for e in self.entries if self.sends_replicated or expert_id(e.name) is not None]

    def _check_experts(self) -> None:
        layers: dict[str, dict[int, set[str]]] = {}
        for e in self.entries:
            m = EXPERT_NAME.match(e.name)
            if m is None:
                continue
            eid = int(m.group("e"))
            if eid not in self.expert_ids:
                raise ConfigError(
                    f"{e.name} (trainer tensor {e.trainer_name}): EP rank {self.ep_rank} of {self.ep_size} holds "
                    f"experts {self.expert_ids.start}..{self.expert_ids.stop - 1}, got expert {eid}"
                )
            layers.setdefault(m.group("pre"), {}).setdefault(eid, set()).add(m.group("post"))
        projections = {f".{p}_proj.weight" for p in ("gate", "up", "down")}
        for pre, experts in layers.items():
            for eid in self.expert_ids:
                lacking = projections - experts.get(eid, set())
                if lacking:
                    raise ConfigError(
                        f"{pre}{eid}{sorted(lacking)[0]}: EP rank {self.ep_rank} must send expert {eid} of "
                        f"{pre.rstrip('.')} whole ({len(lacking)} projection(s) missing)"
                    )

    @property
    def num_bytes(self) -> int:
        """Bytes this rank sends per update (after the dtype cast)."""
        return sum(e.tensor.numel() * self._dtype(e.tensor).itemsize for e in self.entries)

