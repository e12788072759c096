"""Reload benchmark: layerwise reload vs a naive reload, measured side by side in one run.

For each weight format (bf16, fp8 per-tensor, fp8 128x128 blocks) and stream order (block order,
reversed) it times an in-place update of a live reference engine and its peak extra memory (CUDA max
allocated on GPU, VmHWM growth on CPU), next to the naive baseline: allocate a fresh model-format model,
``load_weights`` everything, then quantize every layer. A second part measures the per-name overhead of
planned replay on a model of many small tensors against a bare ``copy_`` loop.

    python benchmarks/bench_reload.py                       # CPU, ~30M-parameter Qwen3
    python benchmarks/bench_reload.py --device cuda --preset qwen3-0.6b --tag h200
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import PeakMemory, env_markdown, environment, median, timed, write_results

from weight_sync import Manifest, begin_update, record_metadata_for_reloading
from weight_sync.engine import ReferenceEngine
from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM
from weight_sync.engine.parallel import TPInfo
from weight_sync.layers import order_by_block
from weight_sync.quant import resolve_quantization
from weight_sync.testing import hf_config, random_weights

FORMATS = {"bf16": None, "fp8": "fp8", "fp8_block": "fp8_block"}


def naive_reload(config: ModelConfig, quant: object, items, device: torch.device) -> nn.Module:
    """What a reload costs without layerwise machinery: a fresh model, load_weights, quantize all."""
    model = CausalLM(config, tp=TPInfo(), quantization=resolve_quantization(quant), device=device)
    for mod in model.modules():
        w = mod._parameters.get("weight")
        if w is not None and w.device.type == "meta":
            real = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=device), requires_grad=False)
            real.__dict__.update(w.__dict__)
            mod._parameters["weight"] = real
    with torch.no_grad():
        model.load_weights(items)
        for mod in model.modules():
            qm = getattr(mod, "quant_method", None)
            if qm is not None and qm.requires_processing:
                qm.process_weights_after_loading(mod)
    return model


def bench_model(args: argparse.Namespace, device: torch.device) -> list[dict]:
    cfg = hf_config("qwen3", args.preset)
    config = ModelConfig.from_hf_dict(cfg)
    rows = []
    source_b = [(n, t.contiguous()) for n, t in random_weights(cfg, seed=1, device=device)]
    nbytes = sum(t.numel() * t.element_size() for _, t in source_b)
    manifest = Manifest.from_named_tensors(source_b)
    for fmt, quant in FORMATS.items():
        if fmt not in args.formats:
            continue
        engine = ReferenceEngine.from_config(
            cfg, weights=random_weights(cfg, seed=0, device=device), device=device, quantization=quant
        )
        for order in ("block order", "reversed"):
            items = source_b if order == "block order" else source_b[::-1]

            def ours(items=items, engine=engine) -> None:
                with begin_update(engine.model, manifest, fingerprint=False) as s:
                    s.load(items)

            ours_s = timed(ours, device, args.repeats)
            with PeakMemory(device) as mem_ours:
                ours()
            gc.collect()

            def naive(items=items, quant=quant) -> None:
                naive_reload(config, quant, items, device)

            naive_s = timed(naive, device, args.repeats)
            with PeakMemory(device) as mem_naive:
                m = naive_reload(config, quant, items, device)
            del m
            gc.collect()
            row = {
                "format": fmt, "order": order, "bytes": nbytes,
                "ours_s": median(ours_s), "naive_s": median(naive_s),
                "time_ratio": median(ours_s) / median(naive_s),
                "ours_peak_extra_bytes": mem_ours.peak_extra_bytes,
                "naive_peak_extra_bytes": mem_naive.peak_extra_bytes,
                "ours_GBps": nbytes / median(ours_s) / 1e9,
            }
            rows.append(row)
            print(f"{fmt:9s} {order:11s} ours {row['ours_s'] * 1e3:8.1f} ms ({row['ours_GBps']:.2f} GB/s) "
                  f"naive {row['naive_s'] * 1e3:8.1f} ms  ratio {row['time_ratio']:.2f}x  "
                  f"peak extra ours {mem_ours.peak_extra_bytes / 1e6:8.1f} MB "
                  f"naive {mem_naive.peak_extra_bytes / 1e6:8.1f} MB", flush=True)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


class ManySmall(nn.Module):
    """Many tiny layers: per-name costs dominate, copies are nearly free."""

    def __init__(self, n: int, device: torch.device) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, device=device) for _ in range(n))


def bench_per_name(args: argparse.Namespace, device: torch.device) -> dict:
    model = ManySmall(args.small_layers, device)
    record_metadata_for_reloading(model)
    params = dict(model.named_parameters())
    items = [(n, torch.randn(params[n].shape, device=device)) for n in order_by_block(params)]
    manifest = Manifest.from_named_tensors(items)
    with begin_update(model, manifest, fingerprint=False) as s:  # first update builds the plan
        s.load(items)
    plan_s = s.report.seconds["plan"]
    load_s, total_s = [], []
    for _ in range(args.repeats):
        with begin_update(model, manifest, fingerprint=False) as s:
            s.load(items)
        load_s.append(s.report.seconds["load"])
        total_s.append(s.report.seconds["total"])

    def raw() -> None:
        with torch.no_grad():
            for n, t in items:
                params[n].copy_(t)

    raw_s = timed(raw, device, args.repeats)

    def naive_loader() -> None:
        # The usual load_weights shape: build the name map, look up, copy (no planning, no checks).
        with torch.no_grad():
            p = dict(model.named_parameters())
            for n, t in items:
                p[n].data.copy_(t)

    naive_s = timed(naive_loader, device, args.repeats)
    n = len(items)
    out = {
        "names": n,
        "ours_load_us_per_name": median(load_s) / n * 1e6,
        "ours_total_us_per_name": median(total_s) / n * 1e6,
        "raw_copy_us_per_name": median(raw_s) / n * 1e6,
        "naive_loader_us_per_name": median(naive_s) / n * 1e6,
        "first_update_plan_s": plan_s,
    }
    out["overhead_us_per_name"] = out["ours_load_us_per_name"] - out["raw_copy_us_per_name"]
    print(f"per name ({n} tensors): ours {out['ours_load_us_per_name']:.2f} us (load), "
          f"{out['ours_total_us_per_name']:.2f} us (whole update incl. verify), raw copy "
          f"{out['raw_copy_us_per_name']:.2f} us, naive loader {out['naive_loader_us_per_name']:.2f} us; "
          f"overhead over raw copy {out['overhead_us_per_name']:.2f} us/name (goal <= 5)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="bench", help="weight_sync.testing preset (bench, qwen3-0.6b, ...)")
    p.add_argument("--formats", default="bf16,fp8,fp8_block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small-layers", type=int, default=2000)
    p.add_argument("--tag", default=None, help="result file suffix (default: the device type)")
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    device = torch.device(args.device)
    torch.manual_seed(0)
    env = environment()
    print(env)
    with torch.no_grad():
        rows = bench_model(args, device)
    per_name = bench_per_name(args, device)
    tag = args.tag or device.type
    payload = {"env": env, "preset": args.preset, "reload": rows, "per_name": per_name}
    md = [f"# Reload benchmark ({tag})", "", env_markdown(env), "",
          f"Model: Qwen3-shaped preset `{args.preset}`, {rows[0]['bytes'] / 1e6:.1f} MB of bf16 "
          "checkpoint tensors per update. Baseline: fresh model-format model + load_weights + quantize "
          "(what a reload costs without in-place layerwise processing). Medians of "
          f"{args.repeats} runs.", "",
          "| format | order | ours ms | naive ms | ours/naive | ours GB/s | ours peak extra MB | naive peak extra MB |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['format']} | {r['order']} | {r['ours_s'] * 1e3:.1f} | {r['naive_s'] * 1e3:.1f} | "
                  f"{r['time_ratio']:.2f}x | {r['ours_GBps']:.2f} | {r['ours_peak_extra_bytes'] / 1e6:.1f} | "
                  f"{r['naive_peak_extra_bytes'] / 1e6:.1f} |")
    pn = per_name
    md += ["", f"Per-name cost on {pn['names']} tiny tensors (8x8 linears): ours "
           f"{pn['ours_load_us_per_name']:.2f} us/name in `load` ({pn['ours_total_us_per_name']:.2f} with "
           f"begin/verify/finish), a bare copy loop {pn['raw_copy_us_per_name']:.2f}, a naive name-map "
           f"loader {pn['naive_loader_us_per_name']:.2f}; overhead over the bare copy "
           f"**{pn['overhead_us_per_name']:.2f} us/name** (goal <= 5). First update (plan built by a "
           f"dry run): {pn['first_update_plan_s']:.2f} s.", ""]
    j, m = write_results(f"reload_{tag}", payload, "\n".join(md))
    print(f"wrote {j} and {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
