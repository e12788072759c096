"""Layerwise offload vs resident (and diffusers group offloading) on a synthetic DiT, in one run.

Per token count it measures, on the same model and device: the resident forward, one block's compute,
one block's H2D from pinned memory, our offloaded forward (no AllGather) and, when diffusers (with
accelerate) is importable, ``apply_group_offloading(block_level, use_stream=True)``. It reports the
physical bound ``max(1, h2d / compute)`` per block, our ratio to it, our ratio to diffusers and the
device peak memory against ``non-block weights + 2 slots + activations``. ``--dp 2`` adds AllGather
(NCCL on GPU, gloo on CPU) against resident at ``--dp-tokens``, in place and with landing buffers
(``dlo_landing_buffers``) side by side, each with its device peak memory. A trace of one offloaded
forward per variant is drawn as a PNG timeline (compute / H2D / AllGather lanes). ``--quantization
fp8_block [fp8 ...]`` adds, per name and token count, our offload with the block linears quantized
online (``OffloadConfig.quantization``) against its baseline measured in the same run: the resident
model quantized the same way (``weight_sync.quant.modules.quantize_linears`` on every block, resident),
with the H2D bytes per block next to the dense ones, the time against the dense (bf16) offload of the
same run, a bitwise check of the outputs and a timeline PNG per name; ``--dequant default three_pass``
times the dequantize variants of ``offload_dequant.py`` side by side.

GPU (defaults: Flux-sized, 16 blocks, hidden 3072, 24 heads, bf16, 1024/4096/16384 tokens):
    python benchmarks/bench_offload.py --dp 2
    python benchmarks/bench_offload.py --quantization fp8_block fp8 --tag h200_fp8   # fp8 streaming
    python benchmarks/bench_offload.py --quantization fp8_block fp8 --dequant default three_pass \
        --tag h200_fp8   # and the earlier three-pass dequantize (offload_dequant.py) side by side
CPU (small):
    python benchmarks/bench_offload.py --device cpu
Writes benchmarks/results/offload_<tag>.json / .md / _timeline.png (with --dp N also
_timeline_dpN.png and _timeline_dpN_landing.png).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import gc
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_dequant import DEQUANT, mismatched_linears, use_dequant
from offload_report import RESULTS, draw_timelines, hardware, write_report

from weight_sync.offload import OffloadConfig, enable_layerwise_offload
from weight_sync.testing.dit import DiTConfig, SyntheticDiT

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ANCHOR_PINNED_H2D_GBPS = 55.0  # measured on the H200 machines (shared/DESIGN.md)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn: Any, device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median wall time of ``fn`` in ms, the device synchronized around each call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _block_bytes(model: SyntheticDiT) -> int:
    return sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())


def _non_block_bytes(model: SyntheticDiT) -> int:
    block_ids = {id(p) for p in model.blocks.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in block_ids)


def _inputs(model: SyntheticDiT, tokens: int, dtype: torch.dtype, device: torch.device) -> tuple:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, model.config.in_channels, generator=g).to(device=device, dtype=dtype)
    return x, torch.full((1,), 0.5, device=device)


def _h2d_ms(nbytes: int, device: torch.device, *, warmup: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return timed_ms(lambda: dst.copy_(src, non_blocking=True), device, warmup=warmup, repeats=repeats)


def _stream_copies(nbytes: int, num_blocks: int, device: torch.device) -> Any:
    """A call that copies ``num_blocks`` blocks of ``nbytes`` from pinned memory into two device slots
    in turn, back to back on one stream: the copy lane of one offloaded forward with nothing else on it."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    slots = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)]

    def run() -> None:
        for i in range(num_blocks):
            slots[i % 2].copy_(src, non_blocking=True)

    return run


def _mem(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _forward_peak_delta(fn: Any, device: torch.device) -> int | None:
    """Extra device memory one call of ``fn`` needs above what is allocated before it (GPU only)."""
    if device.type != "cuda":
        return None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = _mem(device)
    fn()
    _sync(device)
    return int(torch.cuda.max_memory_allocated(device)) - before


def _interleaved_ms(fns: dict[str, Any], device: torch.device, *, warmup: int, repeats: int) -> dict[str, float]:
    """Median ms of each function, timed in turn within every repeat.

    Interleaving keeps the comparison fair when the machine's load drifts (shared CPU hosts): every
    variant sees the same conditions in each round.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in samples.items()}


def _loop_ms(fns: dict[str, Any], device: torch.device, *, steps: int, repeats: int) -> dict[str, float]:
    """Median ms per forward of ``steps`` forwards issued back to back, as a denoising loop runs them.

    The device is synchronized only around the whole loop: a load the streamer queued for the next
    forward (wrap-around prefetch) overlaps this one instead of being charged to it, which a per-forward
    synchronization of every stream does. Variants are interleaved per repeat.
    """
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            fn()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            _sync(device)
            samples[name].append((time.perf_counter() - t0) * 1e3 / steps)
    return {k: statistics.median(v) for k, v in samples.items()}


def _base_model(args: argparse.Namespace, dtype: torch.dtype) -> SyntheticDiT:
    torch.manual_seed(0)
    cfg = DiTConfig(hidden=args.hidden, heads=args.heads, num_blocks=args.num_blocks,
                    in_channels=args.in_channels, time_dim=256)
    return SyntheticDiT(cfg).to(dtype).eval().requires_grad_(False)


def _under(dequant: str, fn: Any, *args: Any) -> Any:
    with use_dequant(dequant):
        return fn(*args)


def measure_quantized(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Per quantization name and dequantize variant: resident quantized (the baseline), ours quantized,
    resident dense; all interleaved in one timing loop per token count.

    The baseline is quantized on the host with the registry's processor, as our offload does, then moved
    to the device, so both compute from the same bytes with the same kernels (bitwise equal outputs).
    ``--dequant three_pass`` swaps the dequantize of ``Fp8LinearMethod.apply`` for both sides
    (``offload_dequant.py``), after checking that it gives the default's weight bitwise for every linear.
    """
    from weight_sync.quant.modules import quantize_linears

    base = _base_model(args, dtype)
    dense_block = _block_bytes(base)
    resident = copy.deepcopy(base).to(device)
    w, r = args.warmup, args.repeats
    rows: list[dict[str, Any]] = []
    traces: dict[str, Any] = {}
    for name in args.quantization:
        q_resident = copy.deepcopy(base)
        with torch.no_grad():
            for block in q_resident.blocks:
                quantize_linears(block, name)
        q_resident = q_resident.to(device)
        for d in args.dequant:
            if d != "default" and (bad := mismatched_linears(q_resident, dtype, d)):
                raise RuntimeError(f"--dequant {d}: the dequantized weight of {len(bad)} {name} linear(s) "
                                   f"differs from the default's (first: {bad[0]}); not timing it")
        ours = copy.deepcopy(base)
        config = OffloadConfig(enable_distributed_layerwise_offload=True, dlo_use_allgather=False,
                               device=str(device), quantization=name)
        handle = enable_layerwise_offload(ours, config)
        q_block = handle.metrics()["block_bytes"] // handle.metrics()["num_streamed_blocks"]
        # More repeats than the forwards get: one 113 MB copy is ~2 ms, and a short median of it moved by
        # 15% between two names of one run (1.77 vs 2.10 ms), which moves the bound as much.
        h2d = _h2d_ms(q_block, device, warmup=w, repeats=max(10, 2 * r))
        stream_all = _stream_copies(q_block, handle.metrics()["num_streamed_blocks"], device)
        with torch.no_grad():
            for tokens in args.tokens:
                x, t = _inputs(base, tokens, dtype, device)
                fns = {"resident": partial(resident, x, t), "h2d_all": stream_all}
                for d in args.dequant:
                    fns[f"resident_q@{d}"] = partial(_under, d, q_resident, x, t)
                    fns[f"ours_q@{d}"] = partial(_under, d, ours, x, t)
                ms = _interleaved_ms(fns, device, warmup=w, repeats=r)
                default_out = _under("default", q_resident, x, t)
                for d in args.dequant:
                    compute = timed_ms(partial(_under, d, q_resident.blocks[0], q_resident.proj_in(x)),
                                       device, warmup=w, repeats=2 * r)
                    bound = max(1.0, h2d / compute)
                    rq, oq = ms[f"resident_q@{d}"], ms[f"ours_q@{d}"]
                    # The forward's own floor: its compute (the resident quantized forward) or its
                    # copies (every streamed block's bytes host -> device, back to back), whichever
                    # is longer, both timed in this interleaved loop.
                    stream_bound = max(rq, ms["h2d_all"])
                    out = fns[f"ours_q@{d}"]()
                    rows.append({
                        "quantization": name, "dequant": d, "tokens": tokens, "resident_q_ms": rq,
                        "ours_q_ms": oq, "resident_ms": ms["resident"],
                        "ours_q_ratio": oq / rq, "compute_per_block_ms": compute,
                        "h2d_per_block_ms": h2d, "bound_ratio": bound,
                        "ours_q_vs_bound": oq / rq / bound,
                        "h2d_all_ms": ms["h2d_all"], "stream_bound_ms": stream_bound,
                        "ours_q_vs_stream_bound": oq / stream_bound,
                        "resident_q_vs_resident": rq / ms["resident"],
                        "block_bytes": q_block, "block_bytes_vs_dense": q_block / dense_block,
                        "bitwise_equal": bool(torch.equal(out, fns[f"resident_q@{d}"]())),
                        "equal_to_default_dequant": bool(torch.equal(out, default_out)),
                    })
        handle.disable()
        if args.trace_tokens:
            # Traced separately (timing events would add to the forwards timed above); enabling again
            # finds the blocks already quantized with this scheme and quantizes nothing.
            handle = enable_layerwise_offload(ours, dataclasses.replace(config, trace=True, trace_capacity=4096))
            x, t = _inputs(base, args.trace_tokens, dtype, device)
            with torch.no_grad():
                for d in args.dequant:
                    _under(d, ours, x, t)
                    handle.reset_trace()  # the timeline starts after a warm-up forward
                    _under(d, ours, x, t)
                    traces[f"{name}_{d}"] = [sp.__dict__ for sp in handle.trace()]
            handle.disable()
        del q_resident, ours, handle, fns
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "traces": traces}


def measure_single(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Resident, per-block compute/H2D, ours and diffusers for every token count, interleaved."""
    base = _base_model(args, dtype)
    cfg = base.config
    block_bytes, non_block = _block_bytes(base), _non_block_bytes(base)
    w, r = args.warmup, args.repeats
    h2d = _h2d_ms(block_bytes, device, warmup=w, repeats=r)

    resident = copy.deepcopy(base).to(device)
    before = _mem(device)
    ours = copy.deepcopy(base)
    handle = enable_layerwise_offload(ours, OffloadConfig(
        enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device=str(device)))
    ours_persistent = _mem(device) - before  # non-block weights + the two slots
    diff_model, diffusers_info = _diffusers_model(base, device)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for tokens in args.tokens:
            x, t = _inputs(base, tokens, dtype, device)
            fns = {"resident": partial(resident, x, t), "ours": partial(ours, x, t)}
            if diff_model is not None:
                fns["diffusers"] = partial(diff_model, x, t)
            ms = _interleaved_ms(fns, device, warmup=w, repeats=r)
            h = resident.proj_in(x)
            blk = resident.blocks[0]
            row: dict[str, Any] = {
                "tokens": tokens,
                "resident_ms": ms["resident"],
                "compute_per_block_ms": timed_ms(partial(blk, h), device, warmup=w, repeats=2 * r),
                "h2d_per_block_ms": h2d,
                "h2d_per_block_ms_at_55GBps": block_bytes / (ANCHOR_PINNED_H2D_GBPS * 1e9) * 1e3,
                "ours_ms": ms["ours"],
            }
            row["bound_ratio"] = max(1.0, h2d / row["compute_per_block_ms"])
            row["ours_ratio"] = row["ours_ms"] / row["resident_ms"]
            row["ours_vs_bound"] = row["ours_ratio"] / row["bound_ratio"]
            if "diffusers" in ms:
                row["diffusers_ms"] = ms["diffusers"]
                row["diffusers_ratio"] = ms["diffusers"] / row["resident_ms"]
                row["ours_vs_diffusers"] = row["ours_ms"] / ms["diffusers"]
            activations = _forward_peak_delta(fns["resident"], device)
            ours_delta = _forward_peak_delta(fns["ours"], device)
            if activations is not None and ours_delta is not None:
                row["activation_bytes"] = activations
                row["ours_peak_bytes"] = ours_persistent + ours_delta
                row["peak_budget_bytes"] = non_block + 2 * handle.metrics()["slot_bytes"] + activations
                row["peak_within_budget"] = row["ours_peak_bytes"] <= row["peak_budget_bytes"] * 1.02
                if diff_model is not None:
                    row["diffusers_peak_bytes"] = _forward_peak_delta(fns["diffusers"], device)
            rows.append(row)
    metrics = handle.metrics()
    handle.disable()
    del fns, blk, h, resident, ours, handle, diff_model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    trace_rows = None
    if args.trace_tokens:
        traced = copy.deepcopy(base)
        th = enable_layerwise_offload(traced, OffloadConfig(
            enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device=str(device),
            trace=True, trace_capacity=4096))
        x, t = _inputs(base, args.trace_tokens, dtype, device)
        with torch.no_grad():
            traced(x, t)
            th.reset_trace()  # start the timeline after the warm-up
            traced(x, t)
        trace_rows = [s.__dict__ for s in th.trace()]
        th.disable()
        del traced
    return {
        "block_bytes": block_bytes, "non_block_bytes": non_block, "num_blocks": cfg.num_blocks,
        "rows": rows, "ours_metrics": metrics, "diffusers": diffusers_info, "trace": trace_rows,
    }


def _diffusers_model(base: SyntheticDiT, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """A copy of ``base`` under diffusers group offloading (block level, streams on GPU), if available."""
    try:
        import diffusers
        from diffusers.hooks import apply_group_offloading
        from diffusers.utils import is_accelerate_available
    except ImportError as e:
        return None, {"available": False, "reason": f"diffusers not importable: {e}"}
    if not is_accelerate_available():
        return None, {"available": False, "reason": "diffusers group offloading needs accelerate"}
    use_stream = device.type == "cuda"
    m = copy.deepcopy(base)
    apply_group_offloading(m, onload_device=device, offload_device=torch.device("cpu"),
                           offload_type="block_level", num_blocks_per_group=1, use_stream=use_stream)
    return m, {"available": True, "version": diffusers.__version__,
               "mode": f"block_level, num_blocks_per_group=1, use_stream={use_stream}"}


def _dp_rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of the AllGather measurement (module level: spawned).

    Times the resident forward, then AllGather in place and AllGather with landing buffers
    (``dlo_landing_buffers``) side by side: both offloaded copies are enabled at once (each with its own
    gather communicator) and timed interleaved per repeat, like the single-rank variants. Device peak
    memory of each = its persistent bytes (non-block weights, slots, landing buffers) + one forward's
    peak above that.
    """
    device = torch.device(opts["device"])
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dtype = _DTYPES[opts["dtype"]]
    torch.manual_seed(0)
    cfg = DiTConfig(**opts["dit"])
    base = SyntheticDiT(cfg).to(dtype).eval().requires_grad_(False)
    x, t = _inputs(base, opts["tokens"], dtype, device)
    w, r = opts["warmup"], opts["repeats"]
    before = _mem(device)
    resident = copy.deepcopy(base).to(device)
    resident_persistent = _mem(device) - before
    with torch.no_grad():
        resident_ms = timed_ms(partial(resident, x, t), device, warmup=w, repeats=r)
        resident_loop_ms = _loop_ms({"resident": partial(resident, x, t)}, device, steps=opts["loop_steps"],
                                    repeats=r)["resident"]
        expected = resident(x, t)
        activations = _forward_peak_delta(partial(resident, x, t), device)
    del resident
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # The physical floor of AllGather offload: every rank copies its 1/dp shard of each block over its
    # own PCIe link at the same time (host memory and any shared switch see all ranks at once), so the
    # shard H2D is timed with every rank copying concurrently, the ranks lined up by a barrier.
    shard_bytes = -(-_block_bytes(base) // world)
    dist.barrier()
    h2d_shard_ms = _h2d_ms(shard_bytes, device, warmup=w, repeats=max(r, 10))
    bound = max(1.0, cfg.num_blocks * h2d_shard_ms / resident_ms)
    non_block = _non_block_bytes(base)
    variants = {"allgather": False, "landing": True}  # name -> dlo_landing_buffers
    models, handles, persistent = {}, {}, {}
    for name, landing in variants.items():
        before = _mem(device)
        models[name] = copy.deepcopy(base)
        handles[name] = enable_layerwise_offload(models[name], OffloadConfig(
            enable_distributed_layerwise_offload=True, data_parallel_size=world, device=str(device),
            dlo_landing_buffers=landing, trace=True, trace_capacity=4096))
        persistent[name] = _mem(device) - before  # non-block weights + 2 slots (+ 2 landing shards)
    fns = {name: partial(m, x, t) for name, m in models.items()}
    with torch.no_grad():
        # Same order on every rank: each variant's collectives run on its own communicator, in order.
        ms = _interleaved_ms(fns, device, warmup=w, repeats=r)
        loop = _loop_ms(fns, device, steps=opts["loop_steps"], repeats=r)
        out: dict[str, dict[str, Any]] = {}
        for name, handle in handles.items():
            delta = _forward_peak_delta(fns[name], device)
            handle.reset_trace()  # trace one steady-state forward
            equal = bool(torch.equal(fns[name](), expected))
            spans = [s.__dict__ for s in handle.trace()] if rank == 0 else None
            m = handle.metrics()
            out[name] = {
                "ms": ms[name], "ratio": ms[name] / resident_ms,
                "loop_ms": loop[name], "loop_ratio": loop[name] / resident_loop_ms,
                "vs_bound": ms[name] / resident_ms / bound, "bitwise_equal": equal,
                "host_bytes_ratio": m["host_bytes"] / m["block_bytes"], "metrics": m, "trace": spans,
                "peak_bytes": None if delta is None else persistent[name] + delta,
                "peak_budget_bytes": None if activations is None else (
                    non_block + 2 * m["slot_bytes"]
                    + m["num_landing_buffers_allocated"] * m["landing_bytes"] + activations),
            }
    for handle in handles.values():
        handle.disable()
    ag, ld = out["allgather"], out["landing"]
    return {"rank": rank, "resident_ms": resident_ms, "resident_loop_ms": resident_loop_ms,
            "loop_steps": opts["loop_steps"],
            "loop": {name: {"ms": o["loop_ms"], "ratio": o["loop_ratio"]} for name, o in out.items()},
            "resident_peak_bytes": None if activations is None else resident_persistent + activations,
            "activation_bytes": activations,
            "h2d_shard_ms_concurrent": h2d_shard_ms,
            "h2d_shard_GBps_concurrent": shard_bytes / h2d_shard_ms / 1e6, "bound_ratio": bound,
            # AllGather in place (the keys earlier results used)
            "allgather_ms": ag["ms"], "ratio": ag["ratio"], "ours_vs_bound": ag["vs_bound"],
            "bitwise_equal": ag["bitwise_equal"], "host_bytes_ratio": ag["host_bytes_ratio"],
            "allgather_peak_bytes": ag["peak_bytes"], "allgather_peak_budget_bytes": ag["peak_budget_bytes"],
            "metrics": ag["metrics"], "trace": ag["trace"],
            # AllGather + landing buffers
            "landing_ms": ld["ms"], "landing_ratio": ld["ratio"], "landing_vs_bound": ld["vs_bound"],
            "landing_bitwise_equal": ld["bitwise_equal"], "landing_host_bytes_ratio": ld["host_bytes_ratio"],
            "landing_peak_bytes": ld["peak_bytes"], "landing_peak_budget_bytes": ld["peak_budget_bytes"],
            "landing_metrics": ld["metrics"], "landing_trace": ld["trace"],
            "landing_vs_allgather": ld["ms"] / ag["ms"]}


def measure_dp(args: argparse.Namespace, device: torch.device) -> dict[str, Any] | None:
    if args.dp < 2:
        return None
    if device.type == "cuda" and torch.cuda.device_count() < args.dp:
        return {"skipped": f"--dp {args.dp} needs {args.dp} GPUs, found {torch.cuda.device_count()}"}
    from weight_sync.testing import run_distributed

    opts = {"device": device.type, "dtype": args.dtype, "tokens": args.dp_tokens,
            "warmup": args.warmup, "repeats": args.repeats, "loop_steps": args.loop_steps,
            "dit": {"hidden": args.hidden, "heads": args.heads, "num_blocks": args.num_blocks,
                    "in_channels": args.in_channels, "time_dim": 256}}
    results = run_distributed(_dp_rank, args.dp, opts, backend="nccl" if device.type == "cuda" else "gloo",
                              timeout_s=900)
    return {"tokens": args.dp_tokens, "dp": args.dp, "ranks": results}


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--in-channels", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dp", type=int, default=0, help="also measure AllGather over this many ranks")
    p.add_argument("--dp-tokens", type=int, default=None)
    p.add_argument("--loop-steps", type=int, default=6,
                   help="AllGather: forwards per back-to-back loop (a denoising loop's steps) for the loop timing")
    p.add_argument("--trace-tokens", type=int, default=None, help="token count for the timeline PNG")
    p.add_argument("--quantization", nargs="+", default=[], metavar="NAME",
                   help="also measure quantized blocks (quant registry names, e.g. fp8_block fp8)")
    p.add_argument("--dequant", nargs="+", choices=sorted(DEQUANT), default=["default"],
                   help="with --quantization: dequantize variants to time side by side (three_pass: "
                        "offload_dequant.py, the earlier formulation: the same weight bitwise in three passes)")
    p.add_argument("--tag", default=None)
    p.add_argument("--threads", type=int, default=None, help="CPU intra-op threads (default: 1 on CPU)")
    p.add_argument("--replot", default=None, metavar="JSON",
                   help="only redraw the PNGs and markdown of an earlier results JSON")
    args = p.parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        tag = Path(args.replot).stem.removeprefix("offload_")
        result["timelines"] = draw_timelines(result, tag)
        print(f"wrote {write_report(result, tag)}: {result['timelines']}")
        return 0
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    args.tokens = args.tokens or ([1024, 4096, 16384] if gpu else [128, 512])
    args.num_blocks = args.num_blocks or (16 if gpu else 6)
    args.hidden = args.hidden or (3072 if gpu else 512)
    args.heads = args.heads or (24 if gpu else 8)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.dp_tokens = args.dp_tokens or (4096 if gpu else args.tokens[-1])
    args.trace_tokens = args.trace_tokens if args.trace_tokens is not None else (4096 if gpu else args.tokens[0])
    tag = args.tag or ("gpu" if gpu else "cpu")
    if gpu:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    else:
        # One intra-op thread: OpenMP barriers on a shared, oversubscribed host turn 2-thread kernels
        # into noise; the submission thread still overlaps copies with compute.
        torch.set_num_threads(args.threads or 1)
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": hardware(device), "args": vars(args),
    }
    result["single"] = measure_single(args, device, _DTYPES[args.dtype])
    for r in result["single"]["rows"]:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    quantized = measure_quantized(args, device, _DTYPES[args.dtype]) if args.quantization else None
    result["quantized"] = quantized["rows"] if quantized else []
    dense_dlo = {r["tokens"]: r["ours_ms"] for r in result["single"]["rows"]}
    for q in result["quantized"]:
        q["vs_dense_dlo"] = q["ours_q_ms"] / dense_dlo[q["tokens"]]  # the "<= 0.55x bf16 DLO"
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in q.items()}), flush=True)
    result["dp"] = measure_dp(args, device)
    if result["dp"] and "ranks" in result["dp"]:
        for r in result["dp"]["ranks"]:
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
                              if k not in ("metrics", "trace", "landing_metrics", "landing_trace")}),
                  flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    # Spans stay in the JSON so the PNGs can be redrawn where matplotlib exists (--replot).
    result["timeline_spans"] = {"single": result["single"].pop("trace"), "dp": None, "dp_landing": None,
                                "quantized": quantized["traces"] if quantized else {}}
    if result["dp"] and "ranks" in result["dp"]:
        result["timeline_spans"]["dp"] = result["dp"]["ranks"][0].get("trace")
        result["timeline_spans"]["dp_landing"] = result["dp"]["ranks"][0].get("landing_trace")
        for r in result["dp"]["ranks"]:
            r.pop("trace", None)
            r.pop("landing_trace", None)
    timelines = draw_timelines(result, tag)
    result["timelines"] = timelines
    md = write_report(result, tag)
    print(f"hardware: {json.dumps(result['hardware'])}")
    print(f"wrote {md}, {md.with_suffix('.json')}" + (f", {', '.join(timelines)}" if timelines else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
