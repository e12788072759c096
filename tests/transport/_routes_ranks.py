"""Functions run on spawned ranks for the route-plan tests (gloo): real TP groups, real FSDP2 DTensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from weight_sync.engine import ReferenceEngine
from weight_sync.engine.parallel import TPInfo
from weight_sync.transport.routes import copy_routes, plan_routes
from weight_sync.transport.routes_layouts import (
    fsdp_holdings,
    holdings_from_dtensors,
    needs_from_model,
)
from weight_sync.transport.routes_reference import reference_checkpoint_metas


@dataclass(frozen=True, slots=True)
class FixedTP(TPInfo):
    """One rank of a TP group of ``fixed_size`` without a process group: loaders only read size and rank."""

    fixed_size: int = 1
    fixed_rank: int = 0

    @property
    def size(self) -> int:
        return self.fixed_size

    @property
    def rank(self) -> int:
        return self.fixed_rank


def engine_rank_applies_its_routes(rank: int, world: int, ckpt: str, expert_parallel: bool) -> dict[str, Any]:
    """Build a TP=world engine rank, announce its needs from its reload plan, apply a Shard(0) plan.

    Returns the rank's needs, the names of parameters the plan's copies got wrong, and the bytes moved.
    """
    engine = ReferenceEngine.from_checkpoint(ckpt, tp_group=dist.group.WORLD, expert_parallel=expert_parallel)
    full = load_file(f"{ckpt}/model.safetensors")
    metas = reference_checkpoint_metas(engine.config)
    needs = needs_from_model(engine.model, metas, rank)
    holdings = fsdp_holdings(metas, world)
    pieces = {(h.name, p.rank): p.box for h in holdings for p in h.pieces}
    plan = plan_routes(holdings, needs)
    want = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    got = {n: torch.zeros_like(p) for n, p in want.items()}

    def source(name: str, src: int) -> torch.Tensor:
        return full[name][tuple(slice(a, b) for a, b in pieces[(name, src)])]

    moved = copy_routes(plan.routes(dst_rank=rank), source, got)
    wrong = sorted(n for n in want if not torch.equal(got[n], want[n]))
    return {"needs": needs, "wrong": wrong, "moved": moved, "needed": plan.needed_bytes()[rank]}


def fsdp_rank_announces_its_shards(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """FSDP2 over an HF model: the holdings read off its DTensors match every rank's local shard."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = dict(model.named_parameters())
    holdings = holdings_from_dtensors(params.items())
    mismatched = []
    for h in holdings:
        mine = [p for p in h.pieces if p.rank == rank]
        local = params[h.name].to_local()  # type: ignore[attr-defined]
        expect = full[h.name][tuple(slice(a, b) for a, b in mine[0].box)]
        if len(mine) != 1 or not torch.equal(local, expect):
            mismatched.append(h.name)
    return {"holdings": holdings, "mismatched": mismatched}
