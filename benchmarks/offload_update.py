"""A weight update of an offloaded DiT, from device tensors and from pinned host tensors, against its bound.

The model is the synthetic DiT of ``bench_offload.py`` (GPU default: Flux-sized, 16 blocks of 227 MB
bf16), offloaded without AllGather (one pinned packed arena). An update (``weight_sync.begin_update`` +
one ``load`` of every tensor + ``finish``, fingerprint off) writes the streamed blocks into the arena in
place and the non-block tensors into their device tensors (``weight_sync.offload.update``). Measured in
the same run, on the same byte counts: the pinned H2D copy (the bound the issue names), the pinned D2H
copy (what an update from device tensors actually moves) and a host memcpy into the arena (what an
update from pinned host tensors moves). Reported: median update time, GB/s, ratio to each bound, the
first forward after the update next to a steady forward (the update drops the prefetched block), and a
check that the served weights equal the source (``handle.fingerprint`` vs ``weight_sync.fingerprint``).

With ``--quantization NAME`` (a quant-registry name, e.g. ``fp8_block``) the offload streams blocks
quantized online at load, and each update requantizes: the full-precision source tensors are quantized
by the registry's processor on the session's device and the fp8 bytes + scales are copied into the
arena. The bound is then the pinned H2D of the quantized bytes the update writes, and "served ==
source" compares with the source model quantized the same way (resident, ``quantize_linears``).

Every update is also run once more per repeat in phases (device synchronized between them), drawn as a
timeline PNG: begin (drain + validation + pointer snapshot), load (copies into the arena / device
tensors), requantize (the processor), copy back (its outputs into the kernel tensors), finish (pointer
audit) and the first forward after the update.

GPU (the lead's commands):  python benchmarks/offload_update.py --tag h200
                            python benchmarks/offload_update.py --tag h200_fp8 --quantization fp8_block
CPU (seconds):              python benchmarks/offload_update.py --quick [--quantization fp8_block]
Writes benchmarks/results/offload_update_<tag>.json / .md / _timeline.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offload import _sync, timed_ms
from offload_report import RESULTS, draw_update_phases, hardware

import weight_sync
from weight_sync.offload import OffloadConfig, enable_layerwise_offload
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _median_s(fn: Any, device: torch.device, *, warmup: int, repeats: int) -> float:
    return timed_ms(fn, device, warmup=warmup, repeats=repeats) / 1e3


def _copy_s(nbytes: int, src: str, dst: str, device: torch.device, *, warmup: int, repeats: int) -> float:
    """One copy of ``nbytes`` between pinned host / device / pageable-arena-like host buffers."""
    def buf(where: str) -> torch.Tensor:
        if where == "device":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        pin = where == "pinned" and device.type == "cuda"
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    a, b = buf(src), buf(dst)
    a.fill_(1)
    return _median_s(lambda: b.copy_(a, non_blocking=True), device, warmup=warmup, repeats=repeats)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    dit = DiTConfig(hidden=args.hidden, heads=args.heads, num_blocks=args.num_blocks, in_channels=64,
                    time_dim=256)
    torch.manual_seed(0)
    pipe = SyntheticDiTPipeline(dit).to(dtype).eval()
    torch.manual_seed(1)
    source = SyntheticDiTPipeline(dit).to(dtype).eval()
    state = source.transformer.state_dict()
    reference = source.transformer
    if args.quantization is not None:
        # The served weights must equal the source quantized the same way, resident (no offload code).
        from weight_sync.quant.modules import quantize_linears

        torch.manual_seed(1)
        reference = SyntheticDiTPipeline(dit).to(dtype).eval().transformer
        for block in reference.blocks:
            quantize_linears(block, args.quantization)
    expected_fp = weight_sync.fingerprint(reference)
    del reference
    handle = enable_layerwise_offload(pipe, OffloadConfig(
        enable_distributed_layerwise_offload=True, dlo_use_allgather=False, device=str(device),
        quantization=args.quantization))
    m = handle.metrics()
    block_bytes = m["block_bytes"]  # what an update writes into the arena (quantized bytes if quantized)
    total_bytes = sum(t.numel() * t.element_size() for t in state.values())
    sources = {
        "device tensors": [(k, v.detach().to(device).contiguous()) for k, v in state.items()],
        "pinned host tensors": [
            (k, v.detach().contiguous().pin_memory() if device.type == "cuda" else v.detach().clone())
            for k, v in state.items()
        ],
    }
    manifest = weight_sync.Manifest.from_named_tensors(sources["device tensors"])
    gen = dict(tokens=args.tokens, num_inference_steps=1, seed=0)
    pipe.generate(**gen)  # warm-up: first loads
    steady_s = _median_s(lambda: pipe.generate(**gen), device, warmup=1, repeats=args.repeats)
    bounds = {
        "pinned_h2d_s": _copy_s(block_bytes, "pinned", "device", device, warmup=1, repeats=args.repeats),
        "pinned_d2h_s": _copy_s(block_bytes, "device", "pinned", device, warmup=1, repeats=args.repeats),
        "host_memcpy_s": _copy_s(block_bytes, "pageable", "pageable", device, warmup=1, repeats=args.repeats),
    }
    rows, phases = [], []
    for label, named in sources.items():
        def update(named: list = named) -> None:
            with weight_sync.begin_update(pipe.transformer, manifest, fingerprint=False) as s:
                s.load(named)

        seconds = _median_s(update, device, warmup=1, repeats=args.repeats)
        t0 = time.perf_counter()
        pipe.generate(**gen)
        _sync(device)
        first_forward_s = time.perf_counter() - t0
        for repeat in range(args.repeats):
            phases.append({"source": label, "repeat": repeat,
                           **_phased_update(pipe, manifest, named, device, gen)})
        served_equal = handle.fingerprint(pipe.transformer) == expected_fp
        own_bound = bounds["pinned_d2h_s"] if label == "device tensors" else bounds["host_memcpy_s"]
        rows.append({
            "source": label, "update_s": seconds, "bytes_written": total_bytes, "block_bytes": block_bytes,
            "gbps": total_bytes / seconds / 1e9,
            "x_pinned_h2d_bound": seconds / bounds["pinned_h2d_s"],
            "x_own_copy_bound": seconds / own_bound,
            "first_forward_s": first_forward_s, "steady_forward_s": steady_s,
            "served_equals_source": served_equal,
        })
    handle.disable()
    return {"bounds": bounds, "rows": rows, "phases": phases, "metrics": handle.metrics(),
            "total_bytes": total_bytes}


def _phased_update(pipe: SyntheticDiTPipeline, manifest: weight_sync.Manifest, named: list,
                   device: torch.device, gen: dict[str, Any]) -> dict[str, float]:
    """One update split into its phases (ms), the device synchronized at each boundary."""
    _sync(device)
    t0 = time.perf_counter()
    s = weight_sync.begin_update(pipe.transformer, manifest, fingerprint=False)
    t1 = time.perf_counter()
    s.load(named)
    _sync(device)
    t2 = time.perf_counter()
    report = s.finish()
    t3 = time.perf_counter()
    pipe.generate(**gen)
    _sync(device)
    t4 = time.perf_counter()
    # With a manifest every layer is processed inside load(), as its last key arrives.
    process, copy_back = report.seconds.get("process", 0.0), report.seconds.get("copy_back", 0.0)
    return {"begin": (t1 - t0) * 1e3, "load": max(t2 - t1 - process - copy_back, 0.0) * 1e3,
            "requantize": process * 1e3, "copy back": copy_back * 1e3, "finish": (t3 - t2) * 1e3,
            "first forward": (t4 - t3) * 1e3}


def write_report(result: dict[str, Any], tag: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    b, a = result["bounds"], result["args"]
    lines = [
        f"# Update of an offloaded DiT ({tag}, {result['date']})", "",
        f"Command: `{result['command']}`", "",
        "Hardware / versions: " + ", ".join(f"{k}={v}" for k, v in result["hardware"].items()), "",
        f"Workload: synthetic DiT, {a['num_blocks']} blocks, hidden {a['hidden']}, {a['dtype']}, offloaded "
        f"without AllGather (packed pinned arena"
        + (f", blocks quantized online with {a['quantization']}; every update requantizes"
           if a.get("quantization") else "")
        + f"); {result['total_bytes'] / 1e9:.3f} GB per update "
        f"({result['rows'][0]['block_bytes'] / 1e9:.3f} GB of blocks into the arena). Median of "
        f"{a['repeats']} after 1 warm-up.", "",
        f"Bounds measured in this run for the block bytes: pinned H2D {b['pinned_h2d_s'] * 1e3:.3f} ms, "
        f"pinned D2H {b['pinned_d2h_s'] * 1e3:.3f} ms, host memcpy {b['host_memcpy_s'] * 1e3:.3f} ms.", "",
        "| source | update ms | GB/s | x pinned H2D bound | x own copy bound | first forward ms | "
        "steady forward ms | served == source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['source']} | {r['update_s'] * 1e3:.1f} | {r['gbps']:.1f} | {r['x_pinned_h2d_bound']:.2f} | "
            f"{r['x_own_copy_bound']:.2f} | {r['first_forward_s'] * 1e3:.1f} | "
            f"{r['steady_forward_s'] * 1e3:.1f} | {r['served_equals_source']} |"
        )
    lines += ["", "Own copy bound: pinned D2H for device tensors, host memcpy for pinned host tensors."]
    if result.get("phases"):
        names = [k for k in result["phases"][0] if k not in ("source", "repeat")]
        lines += ["", "Phases of one update (ms; run again per repeat with the device synchronized at "
                  "each boundary, so the sum is a little above the median above; requantize and copy "
                  "back are the session report's processing times - a layer the reload lifecycle "
                  "quantizes as its keys arrive, straight into the kernel tensors, counts in load):", "",
                  "| source | repeat | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for ph in result["phases"]:
            lines.append(f"| {ph['source']} | {ph['repeat']} | "
                         + " | ".join(f"{ph[n]:.1f}" for n in names) + " |")
    png = RESULTS / f"offload_update_{tag}_timeline.png"
    if result.get("phases") and draw_update_phases(
        result["phases"], png, f"update phases, {a['num_blocks']} blocks, "
        f"{a.get('quantization') or a['dtype']} ({tag})",
    ):
        lines += ["", f"![update timeline]({png.name})"]
    path = RESULTS / f"offload_update_{tag}.md"
    path.write_text("\n".join(lines) + "\n")
    path.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    return path


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small CPU run (seconds); writes nothing unless --tag")
    p.add_argument("--device", default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None)
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--tag", default=None)
    p.add_argument("--quantization", default=None,
                   help="quantize the offloaded blocks online (a quant-registry name, e.g. fp8_block); "
                        "every update then requantizes")
    args = p.parse_args(argv)
    gpu = not args.quick and cuda and args.device != "cpu"
    args.device = args.device or ("cuda" if gpu else "cpu")
    args.num_blocks = args.num_blocks or (16 if gpu else 4)
    args.hidden = args.hidden or (3072 if gpu else 128)
    args.heads = args.heads or (24 if gpu else 4)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.tokens = args.tokens or (1024 if gpu else 16)
    args.repeats = args.repeats or (5 if gpu else 2)
    if not gpu:
        torch.set_num_threads(1)
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": hardware(torch.device(args.device)), "args": vars(args),
    }
    result.update(measure(args))
    for r in result["rows"]:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    print(json.dumps({k: round(v * 1e3, 3) for k, v in result["bounds"].items()}))
    if args.quick and args.tag is None:
        ok = all(r["served_equals_source"] for r in result["rows"])
        print("quick: served weights equal the source" if ok else "quick: FAILED - served != source")
        return 0 if ok else 1
    print(f"wrote {write_report(result, args.tag or ('gpu' if gpu else 'cpu'))}")
    return 0 if all(r["served_equals_source"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
