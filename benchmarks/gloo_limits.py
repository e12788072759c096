"""How fast gloo moves a buffer between two ranks on this host: the ceiling of a CPU sync's transfer.

Two ranks (``run_distributed``, gloo, one torch thread each, as ``bench_delta.py`` runs them) broadcast
a uint8 buffer of each size from rank 0, after a barrier, ``--repeats`` times; best and median seconds
and the rate. No packing, checksums or engine work: what a sync's bytes cost on the wire alone, to set
next to a sync's own time (e.g. a delta's payload against its whole ``send()``).

Usage: ``python benchmarks/gloo_limits.py [--mb 0.08,47.77,1192.1] [--repeats 7] [--tag cpu]``.
Results: ``benchmarks/results/gloo_limits_<tag>.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import env_markdown, environment, write_results
from weight_sync.testing import run_distributed


def broadcast_rank(rank: int, world: int, sizes_mb: list[float], repeats: int) -> dict[float, list[float]]:
    import torch.distributed as dist

    torch.set_num_threads(1)
    out: dict[float, list[float]] = {}
    for mb in sizes_mb:
        buf = torch.zeros(int(mb * 1e6), dtype=torch.uint8)
        times = []
        for _ in range(repeats + 1):  # the first moves the buffer's pages in: not timed
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(buf, 0)
            times.append(time.perf_counter() - t0)
        out[mb] = times[1:]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", default="0.08,47.77,1192.1", help="buffer sizes in MB (1e6 bytes), comma-separated")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--tag", default="cpu")
    args = p.parse_args()
    sizes = [float(x) for x in args.mb.split(",")]
    # Rank 1's clock: its broadcast ends when the bytes have arrived.
    times = run_distributed(broadcast_rank, 2, sizes, args.repeats)[1]
    rows: list[dict[str, Any]] = []
    for mb in sizes:
        best, med = min(times[mb]), statistics.median(times[mb])
        rows.append({"mb": mb, "best_s": best, "median_s": med, "best_GBps": mb / 1e3 / best})
    env = environment()
    lines = [f"# gloo broadcast between two ranks on this host ({args.tag})", "", env_markdown(env), "",
             "| MB | best s | median s | best GB/s |", "|---|---|---|---|"]
    lines += [f"| {r['mb']:g} | {r['best_s']:.4f} | {r['median_s']:.4f} | {r['best_GBps']:.2f} |" for r in rows]
    md = "\n".join(lines) + "\n"
    write_results(f"gloo_limits_{args.tag}", {"environment": env, "repeats": args.repeats, "rows": rows}, md)
    print(md)


if __name__ == "__main__":
    main()
