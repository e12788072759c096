"""Probe: does splitting a pinned host -> device copy over several streams buy PCIe bandwidth?

DLO's AllGather mode is paced by each rank's shard copy (half a 227 MB block at dp=2). This copies a
shard-sized pinned buffer to every GPU at once, as one copy and split over 2 and 4 streams, and prints the
median time and GB/s per GPU. On 2 x H200 (2026-11-30): 51.6-53.8 GB/s in every variant.

    python scripts/h2d_streams_probe.py [--mb 113.4] [--repeats 10]
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=113.4, help="bytes per copy, in MB (default: half a Flux block)")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    n = int(args.mb * 1e6)
    ngpu = torch.cuda.device_count()
    host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(ngpu)]
    dev = [torch.empty(n, dtype=torch.uint8, device=f"cuda:{g}") for g in range(ngpu)]
    streams = [[torch.cuda.Stream(device=g) for _ in range(4)] for g in range(ngpu)]

    def run(g: int, parts: int, out: list[float], barrier: threading.Barrier) -> None:
        torch.cuda.set_device(g)
        chunk = -(-n // parts)
        for r in range(args.repeats + 2):
            barrier.wait()  # every GPU starts its copy together: they share the host's bandwidth
            torch.cuda.synchronize(g)
            t0 = time.perf_counter()
            for i, s in enumerate(streams[g][:parts]):
                with torch.cuda.stream(s):
                    dev[g][i * chunk : (i + 1) * chunk].copy_(host[g][i * chunk : (i + 1) * chunk], non_blocking=True)
            torch.cuda.synchronize(g)
            if r >= 2:
                out.append(time.perf_counter() - t0)

    print(f"{ngpu} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {n / 1e6:.1f} MB per copy")
    for parts in (1, 2, 4):
        for gpus in ([0], list(range(ngpu))):
            barrier = threading.Barrier(len(gpus))
            outs: dict[int, list[float]] = {g: [] for g in gpus}
            threads = [threading.Thread(target=run, args=(g, parts, outs[g], barrier)) for g in gpus]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            med = {g: sorted(v)[len(v) // 2] * 1e3 for g, v in outs.items()}
            print(f"streams={parts} gpus={gpus}: "
                  + ", ".join(f"gpu{g} {m:.3f} ms ({n / m / 1e6:.1f} GB/s)" for g, m in med.items()), flush=True)


if __name__ == "__main__":
    main()
