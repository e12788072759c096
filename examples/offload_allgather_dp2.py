"""Two DP ranks, each holding half of every block on the host, rebuilding blocks with AllGather.

    python examples/offload_allgather_dp2.py     # gloo on CPU; NCCL on two GPUs

Each rank runs its own request of one DP wave (same step count, different seeds) in lockstep and
compares with the resident model.
"""

from __future__ import annotations

import copy

import torch

from weight_sync.offload import (
    DenoiseRequest,
    OffloadConfig,
    enable_layerwise_offload,
    form_waves,
    run_wave,
)
from weight_sync.testing import run_distributed
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline


def rank_main(rank: int, world: int) -> dict[str, object]:
    device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(rank)
    torch.manual_seed(0)  # every rank builds the same weights
    pipe = SyntheticDiTPipeline(DiTConfig(hidden=256, heads=4, num_blocks=6)).eval()
    resident = copy.deepcopy(pipe).to(device)
    handle = enable_layerwise_offload(pipe, OffloadConfig(
        enable_distributed_layerwise_offload=True, data_parallel_size=world, device=device))
    requests = [DenoiseRequest(request_id=f"req{i}", num_inference_steps=4, seed=i) for i in range(world)]
    (wave,) = form_waves(requests, world)  # rejects None / unequal step counts before any collective

    def run(req: DenoiseRequest | None, steps: int) -> torch.Tensor:
        return pipe.generate(tokens=64, num_inference_steps=steps, seed=req.seed if req else 0)

    out = run_wave(wave, dp_rank=handle.dp_rank, run=run)
    expected = resident.generate(tokens=64, num_inference_steps=4, seed=rank)
    m = handle.metrics()
    handle.disable()
    return {"rank": rank, "bitwise_equal": bool(out is not None and torch.equal(out, expected)),
            "host_bytes / block_bytes": round(m["host_bytes"] / m["block_bytes"], 3),
            "fabric_bytes": m["fabric_bytes"]}


if __name__ == "__main__":
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    for result in run_distributed(rank_main, 2, backend=backend):
        print(result)
