"""Spawned ranks for MoE transport tests: rank 0 sends checkpoints, ranks 1..N are one reference engine."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from tests.transport.harness import _share_address
from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender


def moe_updates(rank: int, world: int, backend: str, ckpts: list[str], quantization: Any,
                expert_parallel: bool, zero_copy: bool) -> dict:
    """Rank 0 sends ``ckpts[1:]`` in turn (each a full update); engine ranks start on ``ckpts[0]`` and
    report, per update, their fingerprint, a fresh engine's on the same checkpoint and the report."""
    group = dist.new_group(list(range(1, world))) if world > 2 else None  # every rank takes part
    if rank == 0:
        config = TransportConfig(backend=backend, bucket_bytes=32 << 10, timeout_s=60.0, zero_copy=zero_copy,
                                 **({"checksum": False} if zero_copy else {}))
        sender = WeightSender(config, num_receivers=world - 1)
        _share_address(0, sender.address)
        sender.connect()
        buckets = []
        for version, ckpt in enumerate(ckpts[1:], start=1):
            src = CheckpointSource(ckpt)
            buckets.append(sender.send(src, src.manifest(version), version=version).num_buckets)
        sender.close()
        return {"buckets": buckets}
    address = _share_address(rank, None)
    engine = ReferenceEngine.from_checkpoint(ckpts[0], tp_group=group, quantization=quantization,
                                             expert_parallel=expert_parallel, use_cuda_graph=False)
    receiver = WeightReceiver(engine, address, rank)
    receiver.connect()
    out: dict[str, list] = {"fingerprints": [], "fresh": [], "reports": []}
    for ckpt in ckpts[1:]:
        report = receiver.receive_update()
        out["fingerprints"].append(report.fingerprint)
        out["reports"].append({k: report.to_dict()[k] for k in
                               ("peak_buffered_bytes", "units_processed", "layers_per_unit", "layers_banded",
                                "spilled_bytes")})
        fresh = ReferenceEngine.from_checkpoint(ckpt, tp_group=group, quantization=quantization,
                                                expert_parallel=expert_parallel, use_cuda_graph=False)
        out["fresh"].append(fresh.fingerprint())
    receiver.close()
    return out
