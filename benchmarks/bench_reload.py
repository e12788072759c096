"""Reload benchmark: layerwise reload vs a naive reload, measured side by side in one run.

For each weight format (bf16, fp8 per-tensor, fp8 128x128 blocks) and stream order (block order,
reversed) it times an in-place update of a live reference engine and its peak extra memory (CUDA max
allocated on GPU, VmHWM growth on CPU), next to the naive baseline: allocate a fresh model-format model,
``load_weights`` everything, then quantize every layer. A second part measures the per-name overhead of
planned replay on a model of many small tensors against a bare ``copy_`` loop.

``--arch qwen3_moe`` benchmarks a Qwen3-MoE instead (issue 16): per format and order (block order,
reversed, experts interleaved: every expert of a layer open at once) the reload time next to the naive
path and next to one device copy of the same bytes, the report's peak buffered bytes against one
expert's model-format bytes (whole-layer buffering would be ``num_experts`` of them) and the budget,
and the per-name overhead of the reload (and of the naive path) over that copy on the real name count.

    python benchmarks/bench_reload.py                       # CPU, ~30M-parameter Qwen3
    python benchmarks/bench_reload.py --device cuda --preset qwen3-0.6b --tag h200
    python benchmarks/bench_reload.py --arch qwen3_moe --preset tiny               # CPU smoke run
    python benchmarks/bench_reload.py --arch qwen3_moe --preset qwen3-30b-a3b --layers 24 \\
        --device cuda --tag h200                            # the 30B-A3B shape, half its layers
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PeakMemory,
    cast_copy_eps,
    env_markdown,
    environment,
    format_bound_s,
    fp8_elements,
    median,
    timed,
    write_results,
)

from weight_sync import Manifest, begin_update, record_metadata_for_reloading
from weight_sync.engine import ReferenceEngine
from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM
from weight_sync.engine.parallel import TPInfo
from weight_sync.layers import order_by_block
from weight_sync.quant import resolve_quantization
from weight_sync.testing import hf_config, random_weights

FORMATS = {"bf16": None, "fp8": "fp8", "fp8_block": "fp8_block", "fp8_channel": "fp8_per_channel"}
BOUND_NOTE = ("Bound per format, from the same run: bf16 one device copy; fp8_block and fp8_channel what the "
              "engine holds in fp8 read once and written once as fp8 (a bf16 -> fp8 cast copy of as many elements, one "
              "launch on <= 512 M elements, scaled) plus a device copy of the rest; fp8 (per-tensor scales, "
              "which need the absmax first) 5/3 of that cast copy plus the rest (issue 15's two-read bound).")


def naive_reload(config: ModelConfig, quant: object, items, device: torch.device) -> nn.Module:
    """What a reload costs without layerwise machinery: a fresh model, load_weights, quantize all."""
    model = CausalLM(config, tp=TPInfo(), quantization=resolve_quantization(quant), device=device)
    for mod in model.modules():
        for name, w in list(mod._parameters.items()):  # weight, and the fused experts' w13/w2
            if w is not None and w.device.type == "meta":
                real = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=device), requires_grad=False)
                real.__dict__.update(w.__dict__)
                mod._parameters[name] = real
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
    # The bound of a bf16 reload: one device copy of the same bytes (issue 15's goal is <= 1.15x of it).
    copy_s, copy_Bps = _device_copy_s(nbytes, device, max(args.repeats, 5))
    cast_eps = cast_copy_eps(device, max(args.repeats, 5)) if set(args.formats) - {"bf16"} else 0.0
    print(f"{args.preset}: {len(source_b)} tensors, {nbytes / 1e9:.2f} GB; one device copy {copy_s * 1e3:.2f} ms "
          f"({copy_Bps / 1e9:.1f} GB/s); bf16 -> fp8 cast copy {cast_eps / 1e9:.1f} G elements/s", flush=True)
    for fmt, quant in FORMATS.items():
        if fmt not in args.formats:
            continue
        engine = ReferenceEngine.from_config(
            cfg, weights=random_weights(cfg, seed=0, device=device), device=device, quantization=quant
        )
        bound_s = format_bound_s(fmt, fp8_elements(engine.model), nbytes, copy_Bps, cast_eps)
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
                "copy_s": copy_s, "ours_over_copy": median(ours_s) / copy_s,
                "bound_s": bound_s, "ours_over_bound": median(ours_s) / bound_s,
            }
            rows.append(row)
            print(f"{fmt:9s} {order:11s} ours {row['ours_s'] * 1e3:8.1f} ms ({row['ours_GBps']:.2f} GB/s) "
                  f"naive {row['naive_s'] * 1e3:8.1f} ms  ratio {row['time_ratio']:.2f}x  copy {row['ours_over_copy']:.2f}x  "
                  f"bound {row['ours_over_bound']:.2f}x ({bound_s * 1e3:.1f} ms)  "
                  f"peak extra ours {mem_ours.peak_extra_bytes / 1e6:8.1f} MB "
                  f"naive {mem_naive.peak_extra_bytes / 1e6:8.1f} MB", flush=True)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


MOE_ORDERS = ("block order", "reversed", "experts interleaved")


def _moe_order(items: list[tuple[str, torch.Tensor]], order: str) -> list[tuple[str, torch.Tensor]]:
    if order == "block order":
        return items
    if order == "reversed":
        return items[::-1]
    # Per block: the other tensors, then every expert's gate, then every up, then every down, so each
    # expert's last key comes only after all experts opened (the worst case for buffering).
    rank = {"gate_proj": 1, "up_proj": 2, "down_proj": 3}
    blocks: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for n, t in items:
        blocks.setdefault(n.split(".mlp.")[0] if ".layers." in n else n, []).append((n, t))
    out = []
    for group in blocks.values():
        out += sorted(group, key=lambda it: rank.get(it[0].split(".")[-2], 0) if ".experts." in it[0] else 0)
    return out


def _device_copy_s(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """(seconds for one device copy of ``nbytes``, bytes/s), measured on a buffer of at most 1 GiB and
    scaled: copying the update's bytes as one tensor would need two more copies of them in memory."""
    size = min(nbytes, 1 << 30)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = median(timed(lambda: dst.copy_(src), device, repeats))
    return nbytes / (size / t), size / t


def bench_moe(args: argparse.Namespace, device: torch.device) -> list[dict]:
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    cfg = hf_config("qwen3_moe", args.preset, **overrides)
    config = ModelConfig.from_hf_dict(cfg)
    num_experts, inter, hidden = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    one_expert_bytes = 3 * inter * hidden * 2  # gate + up + down in bf16 (model format)
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    # The largest non-expert layer a quantized engine buffers: the fused qkv projection.
    qkv_bytes = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim * hidden * 2
    items = [(n, t.contiguous()) for n, t in random_weights(cfg, seed=1, device=device)]
    by_name = dict(items)
    items = [(n, by_name[n]) for n in order_by_block(by_name)]
    nbytes = sum(t.numel() * t.element_size() for _, t in items)
    if device.type == "cuda":
        # The engine, the trainer-side source and the naive path's fresh model are alive together.
        free, _ = torch.cuda.mem_get_info(device)
        if 2 * nbytes > free:
            raise SystemExit(f"{args.preset} with {cfg['num_hidden_layers']} layers needs about "
                             f"{3 * nbytes / 1e9:.0f} GB (engine + source + the naive path's model); "
                             f"{free / 1e9:.0f} GB free: pass --layers N")
    manifest = Manifest.from_named_tensors(items)
    copy_s, copy_Bps = _device_copy_s(nbytes, device, args.repeats)
    cast_eps = cast_copy_eps(device, max(args.repeats, 5)) if set(args.formats) - {"bf16"} else 0.0
    print(f"{args.preset}: {cfg['num_hidden_layers']} layers, {len(items)} tensors, {nbytes / 1e9:.2f} GB; "
          f"one expert {one_expert_bytes / 1e6:.2f} MB, one layer's experts "
          f"{num_experts * one_expert_bytes / 1e6:.1f} MB; one device copy {copy_s * 1e3:.1f} ms "
          f"({copy_Bps / 1e9:.1f} GB/s)", flush=True)
    rows = []
    for fmt, quant in FORMATS.items():
        if fmt not in args.formats:
            continue
        # No CUDA graphs: this measures updates, not decoding (graph decode runs every expert per token).
        engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device=device),
                                             device=device, quantization=quant, use_cuda_graph=False)
        bound_s = format_bound_s(fmt, fp8_elements(engine.model), nbytes, copy_Bps, cast_eps)
        for order in MOE_ORDERS:
            stream = _moe_order(items, order)
            reports = []

            def ours(stream=stream, engine=engine, reports=reports) -> None:
                with begin_update(engine.model, manifest, fingerprint=False, budget_bytes=args.budget_bytes) as s:
                    s.load(stream)
                reports.append(s.report)

            ours_s = median(timed(ours, device, args.repeats))
            report = reports[-1]

            def naive(stream=stream, quant=quant) -> None:
                naive_reload(config, quant, stream, device)

            naive_s = median(timed(naive, device, args.repeats))
            gc.collect()
            row = {
                "format": fmt, "order": order, "bytes": nbytes, "names": len(items),
                "ours_s": ours_s, "naive_s": naive_s, "time_ratio": ours_s / naive_s,
                "copy_s": copy_s, "ours_over_copy": ours_s / copy_s,
                "bound_s": bound_s, "ours_over_bound": ours_s / bound_s,
                "ours_overhead_us_per_name": (ours_s - copy_s) / len(items) * 1e6,
                "naive_overhead_us_per_name": (naive_s - copy_s) / len(items) * 1e6,
                "peak_buffered_bytes": report.peak_buffered_bytes,
                "spilled_bytes": report.spilled_bytes,
                "budget_bytes": report.budget_bytes,
                "one_expert_bytes": one_expert_bytes,
                "qkv_bytes": qkv_bytes,
                "peak_over_one_expert": report.peak_buffered_bytes / one_expert_bytes,
                "layers_per_unit": len(report.layers_per_unit),
                "units_processed": report.units_processed,
                "seconds": dict(report.seconds),
            }
            rows.append(row)
            print(f"{fmt:9s} {order:19s} ours {ours_s * 1e3:8.1f} ms naive {naive_s * 1e3:8.1f} ms "
                  f"({row['time_ratio']:.2f}x) copy {row['ours_over_copy']:.2f}x bound {row['ours_over_bound']:.2f}x "
                  f"({bound_s * 1e3:.1f} ms)  peak buffered "
                  f"{report.peak_buffered_bytes / 1e6:.2f} MB = {row['peak_over_one_expert']:.2f} experts "
                  f"(budget {report.budget_bytes / 1e6:.2f} MB, spilled {report.spilled_bytes / 1e6:.1f} MB)  "
                  f"overhead/name ours {row['ours_overhead_us_per_name']:.2f} us naive "
                  f"{row['naive_overhead_us_per_name']:.2f} us  units {report.units_processed}", flush=True)
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def moe_markdown(args: argparse.Namespace, tag: str, env: dict, rows: list[dict], command: str) -> str:
    r0 = rows[0]
    md = [f"# MoE reload benchmark ({tag}, {args.preset})", "", env_markdown(env), "",
          f"Model: Qwen3-MoE preset `{args.preset}`"
          + (f" with {args.layers} layers (fewer than the preset's, for memory)" if args.layers else "")
          + f", {r0['names']} tensor names, {r0['bytes'] / 1e9:.3f} GB of bf16 checkpoint tensors per update; "
          f"one expert {r0['one_expert_bytes'] / 1e6:.2f} MB in model format (the fused qkv of a block, the "
          f"largest other layer a quantized engine buffers: {r0['qkv_bytes'] / 1e6:.2f} MB). Baselines in the same run: the "
          "naive path (a fresh model-format model, `load_weights`, quantize every layer) and one device copy "
          f"of the same bytes ({r0['copy_s'] * 1e3:.3f} ms, measured on <= 1 GiB and scaled). Overhead per "
          f"name = (time - copy) / names. Medians of {args.repeats} runs after one warm-up.", "",
          BOUND_NOTE, "",
          "| format | order | ours ms | naive ms | ours/naive | ours/copy | bound ms | ours/bound "
          "| overhead us/name (ours / naive) "
          "| peak buffered MB | = experts | budget MB | spilled MB | experts processed one by one |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['format']} | {r['order']} | {r['ours_s'] * 1e3:.1f} | {r['naive_s'] * 1e3:.1f} | "
                  f"{r['time_ratio']:.2f}x | {r['ours_over_copy']:.2f}x | {r['bound_s'] * 1e3:.1f} | "
                  f"{r['ours_over_bound']:.2f}x | {r['ours_overhead_us_per_name']:.2f} / "
                  f"{r['naive_overhead_us_per_name']:.2f} | {r['peak_buffered_bytes'] / 1e6:.2f} | "
                  f"{r['peak_over_one_expert']:.2f} | {r['budget_bytes'] / 1e6:.2f} | "
                  f"{r['spilled_bytes'] / 1e6:.1f} | {r['units_processed']} |")
    md += ["", "Goals (issue 16, GPU): peak buffered <= 1.1 experts (+ the non-expert layer in flight: "
           "in block order the peak is max(one expert, the qkv)) in block order and <= the budget out of "
           "order; overhead <= 3 us/name; bf16 <= 1.3x one device copy. On CPU the numbers only show that "
           "the benchmark runs: copies and launches cost differently there. bf16 experts are written in "
           "place (direct path): their peak is the largest other processed layer (none on the reference "
           "engine in bf16), not an expert.", ""]
    return "\n".join(md)


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
    p.add_argument("--arch", default="qwen3", choices=("qwen3", "qwen3_moe"))
    p.add_argument("--preset", default=None,
                   help="weight_sync.testing preset (qwen3: bench (default), qwen3-0.6b, ...; "
                        "qwen3_moe: tiny (default), qwen3-30b-a3b)")
    p.add_argument("--layers", type=int, default=None, help="qwen3_moe: fewer layers than the preset (memory)")
    p.add_argument("--budget-bytes", type=int, default=None,
                   help="qwen3_moe: the update's staging budget (default: the session's, one block)")
    p.add_argument("--formats", default="bf16,fp8,fp8_block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--small-layers", type=int, default=2000)
    p.add_argument("--tag", default=None, help="result file suffix (default: the device type)")
    args = p.parse_args(argv)
    args.formats = args.formats.split(",")
    args.preset = args.preset or ("tiny" if args.arch == "qwen3_moe" else "bench")
    if args.layers is not None and (args.arch != "qwen3_moe" or args.layers < 1):
        p.error("--layers takes a positive count and applies to --arch qwen3_moe")
    device = torch.device(args.device)
    torch.manual_seed(0)
    env = environment()
    print(env)
    if args.arch == "qwen3_moe":
        with torch.no_grad():
            rows = bench_moe(args, device)
        tag = args.tag or device.type
        layers = f"_{args.layers}l" if args.layers else ""
        command = "python benchmarks/bench_reload.py " + " ".join(sys.argv[1:] if argv is None else argv)
        payload = {"env": env, "arch": args.arch, "preset": args.preset, "layers": args.layers,
                   "command": command, "reload": rows}
        j, m = write_results(f"reload_moe_{tag}_{args.preset}{layers}", payload,
                             moe_markdown(args, tag, env, rows, command))
        print(f"wrote {j} and {m}")
        return 0
    with torch.no_grad():
        rows = bench_model(args, device)
    per_name = bench_per_name(args, device)
    tag = args.tag or device.type
    payload = {"env": env, "preset": args.preset, "reload": rows, "per_name": per_name}
    md = [f"# Reload benchmark ({tag})", "", env_markdown(env), "",
          f"Model: Qwen3-shaped preset `{args.preset}`, {rows[0]['bytes'] / 1e6:.1f} MB of bf16 "
          "checkpoint tensors per update. Baseline: fresh model-format model + load_weights + quantize "
          "(what a reload costs without in-place layerwise processing). Medians of "
          f"{args.repeats} runs. Bound: one device copy of the same bytes, "
          f"{rows[0]['copy_s'] * 1e3:.2f} ms in this run (measured on <= 1 GiB and scaled).", "",
          BOUND_NOTE, "",
          "| format | order | ours ms | naive ms | ours/naive | ours/copy | bound ms | ours/bound | ours GB/s "
          "| ours peak extra MB | naive peak extra MB |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['format']} | {r['order']} | {r['ours_s'] * 1e3:.1f} | {r['naive_s'] * 1e3:.1f} | "
                  f"{r['time_ratio']:.2f}x | {r['ours_over_copy']:.2f}x | {r['bound_s'] * 1e3:.1f} | "
                  f"{r['ours_over_bound']:.2f}x | {r['ours_GBps']:.2f} | "
                  f"{r['ours_peak_extra_bytes'] / 1e6:.1f} | "
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
