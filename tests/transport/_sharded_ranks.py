"""Functions run on spawned ranks for the sharded data-plane tests (gloo): FSDP2 trainers, TP engine ranks.

Ranks ``0..T-1`` are trainer ranks, ranks ``T..`` engine ranks (engine ``j``'s TP rank ``t`` is engine
rank ``j * 2 + t``). The trainers' next version is the checkpoint plus a small step per update, applied
to their local shards; an engine rank checks itself against a fresh rank loaded with the same weights
whole through the engine's own loaders.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.transport._routes_ranks import FixedTP
from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM
from weight_sync.transport.sharded import ShardedConfig, ShardedSender
from weight_sync.transport.sharded_receiver import ShardedReceiver

NUM_TRAINERS = 2
TP = 2


def step(t: torch.Tensor, version: int) -> torch.Tensor:
    """Version ``version``'s change, elementwise (so a shard and the whole tensor change alike)."""
    return t.add_(0.01 * version)


def expected_weights(ckpt: str, version: int) -> dict[str, torch.Tensor]:
    """The trainers' weights after updates 1..version, computed whole from the checkpoint."""
    full = load_file(f"{ckpt}/model.safetensors")
    for v in range(1, version + 1):
        for t in full.values():
            step(t, v)
    return full


def engine_rank_model(ckpt: str, engine_rank: int) -> CausalLM:
    """A zero-filled engine rank (TP rank ``engine_rank % 2``): an element no region writes stays 0."""
    with open(f"{ckpt}/config.json") as f:
        cfg = ModelConfig.from_hf_dict(json.load(f))
    model = CausalLM(cfg, tp=FixedTP(fixed_size=TP, fixed_rank=engine_rank % TP))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def wrong_parameters(model: CausalLM, ckpt: str, engine_rank: int, version: int) -> list[str]:
    """Parameters of ``model`` that differ from a fresh rank loaded with version ``version`` whole."""
    fresh = engine_rank_model(ckpt, engine_rank)
    fresh.load_weights(expected_weights(ckpt, version).items())
    got = dict(model.named_parameters())
    return sorted(n for n, p in fresh.named_parameters() if not torch.equal(got[n], p))


def _share_address(address: str | None, rank: int) -> str:
    """Trainer rank 0's store address to every rank (a uint8 tensor over the test's world group)."""
    buf = torch.zeros(256, dtype=torch.uint8)
    if rank == 0:
        raw = address.encode()  # type: ignore[union-attr]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return bytes(buf[buf != 0].tolist()).decode()


def fsdp_trainers_to_tp_engines(rank: int, world: int, ckpt: str, num_updates: int) -> dict[str, Any]:
    """``num_updates`` sharded updates, then one over a new transport in broadcast mode.

    Trainer ranks return their per-engine-rank region bytes per update; engine ranks the parameters
    that differ from a fresh load after each update and the region bytes they received.
    """
    trainers = dist.new_group(list(range(NUM_TRAINERS)))  # every rank takes part in creating a group
    num_engine_ranks = world - NUM_TRAINERS
    out: dict[str, Any] = {"updates": []}
    modes = ["sharded"] * num_updates + ["broadcast"]
    if rank < NUM_TRAINERS:
        import transformers
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        from trainers.fsdp import FSDPSource

        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
        mesh = DeviceMesh.from_group(trainers, "cpu")
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        source = FSDPSource(model, group=trainers)
        sender = None
        for version, mode in enumerate(modes, start=1):
            if version == 1 or mode != modes[version - 2]:
                if sender is not None:
                    sender.close()
                cfg = ShardedConfig(num_trainers=NUM_TRAINERS, num_engine_ranks=num_engine_ranks, mode=mode,
                                    bucket_bytes=16 << 10, timeout_s=30.0, host="127.0.0.1")
                if rank == 0:
                    sender = ShardedSender(cfg, 0)
                    _share_address(sender.address, 0)
                else:
                    sender = ShardedSender(cfg, rank, _share_address(None, rank))
                sender.connect()
            with torch.no_grad():
                for p in model.parameters():
                    step(p, version)
            holdings, local, manifest = source.shards()
            report = sender.send(local, holdings, manifest, version=version)  # type: ignore[union-attr]
            out["updates"].append({"mode": report.mode, "region_bytes": report.region_bytes})
        sender.close()  # type: ignore[union-attr]
        return out
    d = rank - NUM_TRAINERS
    engine = engine_rank_model(ckpt, d)
    receiver = None
    for version, mode in enumerate(modes, start=1):
        if version == 1 or mode != modes[version - 2]:
            if receiver is not None:
                receiver.close()
            receiver = ShardedReceiver(engine, _share_address(None, rank), d, rollback=True)
            receiver.connect()
        update = receiver.receive_update()  # type: ignore[union-attr]
        last = receiver.last_report  # type: ignore[union-attr]
        out["updates"].append({
            "version": update.version, "mode": last.mode, "region_bytes": last.region_bytes,
            "wrong": wrong_parameters(engine, ckpt, d, version),
        })
    receiver.close()  # type: ignore[union-attr]
    return out
