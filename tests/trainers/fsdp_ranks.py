"""Functions run on spawned trainer ranks (FSDP2 on gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainers import FSDPSource
from weight_sync.errors import SourceError


def _sharded_model(ckpt: str):
    import transformers
    from torch.distributed.fsdp import fully_shard

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, full


def gather_all(rank: int, world: int, ckpt: str) -> dict:
    model, full = _sharded_model(ckpt)
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    source = FSDPSource(model, dtype=torch.bfloat16)
    manifest = source.manifest()
    if rank == 0:
        received = []
        for name, t in source:
            # Keep only a checksum-worthy copy; drop the gathered tensor like a sender does after packing.
            received.append((name, t.clone()))
            del t
        equal = all(torch.equal(t, full[n].to(torch.bfloat16)) for n, t in received)
        names = [n for n, _ in received]
    else:
        source.participate()
        equal, names = None, None
    return {
        "equal": equal, "names": names, "manifest": list(manifest.names),
        "manifest_shapes": [tuple(m.shape) for m in manifest], "full_shapes": {n: tuple(t.shape) for n, t in full.items()},
        "peak": source.peak_live_bytes, "largest_block": source.largest_block_bytes, "shard_bytes": shard_bytes,
        "total_bytes": sum(t.numel() * 2 for t in full.values()),
    }


def sender_stops_early(rank: int, world: int, ckpt: str) -> dict:
    model, _ = _sharded_model(ckpt)
    source = FSDPSource(model)
    if rank == 0:
        it = iter(source)
        for _ in range(3):
            next(it)
        it.close()  # the transport failed: the generator tells the other ranks
        # The group is still usable afterwards: nobody is stuck in a half-matched collective.
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"error": None, "after": float(t)}
    try:
        source.participate()
        return {"error": None}
    except SourceError as e:
        t = torch.ones(1)
        dist.all_reduce(t)
        return {"error": str(e), "after": float(t)}


def sender_never_starts(rank: int, world: int, ckpt: str) -> dict:
    model, _ = _sharded_model(ckpt)
    source = FSDPSource(model)
    if rank == 0:
        source.abort()  # what WeightSender does when a call fails before reading the source
        return {"error": None}
    try:
        source.participate()
        return {"error": None}
    except SourceError as e:
        return {"error": str(e)}
