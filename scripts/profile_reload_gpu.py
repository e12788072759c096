"""Where an in-place reload's time goes on one GPU: kernels, launches, host time, against the copy bound.

For each format it times an update of a live reference engine from device tensors (CUDA events and wall),
the device-copy bound of the same bytes (one read + one write into preallocated tensors, one launch per
tensor, as the fastest reload could do), and profiles one update with ``torch.profiler``: the top kernels
by device time, the number of launches, and the device-busy fraction. Diagnostic only (no result file):
the benchmark of record is ``benchmarks/bench_reload.py``.

    python scripts/profile_reload_gpu.py --preset qwen3-8b --formats bf16,fp8,fp8_per_channel,fp8_block
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from weight_sync import Manifest, begin_update
from weight_sync.engine import ReferenceEngine
from weight_sync.testing import hf_config, random_weights


def cuda_ms(fn, repeats: int) -> tuple[float, float]:
    """Median device time (events) and wall time of ``fn`` in ms."""
    fn()
    torch.cuda.synchronize()
    dev, wall = [], []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
        dev.append(a.elapsed_time(b))
    return sorted(dev)[len(dev) // 2], sorted(wall)[len(wall) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="qwen3", help="qwen3 or qwen3_moe")
    p.add_argument("--preset", default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset (memory)")
    p.add_argument("--formats", default="bf16,fp8,fp8_per_channel,fp8_block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--cprofile", type=int, default=0, help="also print the top N host functions (cProfile)")
    args = p.parse_args()
    device = torch.device("cuda")
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    cfg = hf_config(args.arch, args.preset, **overrides)
    source = [(n, t.contiguous()) for n, t in random_weights(cfg, seed=1, device=device)]
    nbytes = sum(t.numel() * t.element_size() for _, t in source)
    manifest = Manifest.from_named_tensors(source)
    dst = [torch.empty_like(t) for _, t in source]

    def copy_bound() -> None:
        for d, (_, s) in zip(dst, source):
            d.copy_(s)

    copy_dev, copy_wall = cuda_ms(copy_bound, args.repeats)
    print(f"{len(source)} tensors, {nbytes / 1e9:.2f} GB; device copy bound {copy_dev:.2f} ms "
          f"(wall {copy_wall:.2f}), {2 * nbytes / copy_dev / 1e6:.0f} GB/s read+write", flush=True)
    dst.clear()
    for fmt in args.formats.split(","):
        quant = None if fmt == "bf16" else fmt
        engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device=device),
                                             device=device, quantization=quant)

        reports: list = []
        begun: list[float] = []

        def ours(engine=engine, reports=reports, begun=begun) -> None:
            t0 = time.perf_counter()
            with begin_update(engine.model, manifest, fingerprint=False) as s:
                begun.append(time.perf_counter() - t0)
                s.load(source)
            reports.append(s.report)

        dev, wall = cuda_ms(ours, args.repeats)
        last = reports[-1].seconds
        print(f"   host phases of the last update (ms): begin {begun[-1] * 1e3:.2f}, "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in last.items() if v > 1e-5), flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ours()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernel_total = sum(e.self_device_time_total for e in events) / 1e3
        launches = sum(e.count for e in events)
        print(f"\n== {fmt}: device {dev:.2f} ms, wall {wall:.2f} ms ({dev / copy_dev:.2f}x / {wall / copy_dev:.2f}x "
              f"the copy bound); kernels {kernel_total:.2f} ms over {launches} launches", flush=True)
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
            print(f"   {e.self_device_time_total / 1e3:8.2f} ms  x{e.count:5d}  {e.key[:110]}")
        cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        print("   host top:", "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.1f}ms x{e.count}" for e in cpu))
        if args.cprofile:
            import cProfile
            import pstats

            prof_py = cProfile.Profile()
            prof_py.enable()
            ours()
            torch.cuda.synchronize()
            prof_py.disable()
            pstats.Stats(prof_py).sort_stats("tottime").print_stats(args.cprofile)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
