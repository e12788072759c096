"""Probe: what slows a rank's shard H2D copy inside DLO's AllGather pipeline on 2 GPUs?

Each rank copies half a Flux block (113.4 MB) from pinned memory, back to back, while nothing else, bf16
GEMMs of a block's size, NCCL all-gathers of the same shards, both, device-to-device copies (HBM-bound)
or flash attention over 4096 tokens run on other streams of its GPU; every rank copies at once, as in the
pipeline. Prints the median ms and GB/s per copy.

    python scripts/dlo_contention_probe.py [--mb 113.4] [--copies 12]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from weight_sync.testing import run_distributed


def _rank(rank: int, world: int, mb: float, copies: int) -> dict[str, float]:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    n = int(mb * 1e6) // 2 * 2
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    landing = torch.empty(n, dtype=torch.uint8, device=dev)
    gathered = torch.empty(n * world, dtype=torch.uint8, device=dev)
    a = torch.randn(4096, 3072, dtype=torch.bfloat16, device=dev)
    b = torch.randn(3072, 12288, dtype=torch.bfloat16, device=dev)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    q = torch.randn(1, 24, 4096, 128, dtype=torch.bfloat16, device=dev)
    h2d, comp, comm = (torch.cuda.Stream(dev) for _ in range(3))
    group = dist.new_group(backend="nccl")
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out: dict[str, float] = {}
    kernels = {
        "gemm": lambda: torch.matmul(a, b),  # ~0.25 ms each
        "hbm copy": lambda: big2.copy_(big),  # ~0.5 ms each, memory-bound
        "attention": lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q),
    }
    for label, background, with_gather in (("alone", None, False), ("+gemm", "gemm", False),
                                           ("+allgather", None, True), ("+gemm+allgather", "gemm", True),
                                           ("+hbm copy", "hbm copy", False), ("+attention", "attention", False)):
        times = []
        for rep in range(3):
            dist.barrier(group=group, device_ids=[rank])
            torch.cuda.synchronize(dev)
            if background is not None:
                with torch.cuda.stream(comp):
                    for _ in range(40 * copies):  # longer than the copies
                        kernels[background]()
            if with_gather:
                with torch.cuda.stream(comm):
                    for _ in range(6 * copies):
                        gather(gathered, landing, group=group)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(copies + 1)]
            with torch.cuda.stream(h2d):
                events[0].record()
                for i in range(copies):
                    landing.copy_(host, non_blocking=True)
                    events[i + 1].record()
            torch.cuda.synchronize(dev)
            if rep:
                times += [events[i].elapsed_time(events[i + 1]) for i in range(1, copies)]
        out[label] = statistics.median(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=113.4)
    p.add_argument("--copies", type=int, default=12)
    args = p.parse_args()
    world = min(2, torch.cuda.device_count())
    results = run_distributed(_rank, world, args.mb, args.copies, timeout_s=300)
    print(f"{world} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.mb:.1f} MB per copy")
    for label in results[0]:
        print(f"{label:>11}: " + ", ".join(
            f"rank {r} {res[label]:.3f} ms ({args.mb / res[label]:.1f} GB/s)" for r, res in enumerate(results)))


if __name__ == "__main__":
    main()
