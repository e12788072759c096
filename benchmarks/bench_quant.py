"""Online fp8 quantization of a whole model's linears against the memory bound, measured in one run.

The weights are the linear layers of a Qwen3 preset (qkv, o, gate_up, down per layer), bf16 on the device,
quantized into preallocated fp8 weights and fp32 scales as a reload does (``quantize_fp8(..., out=)``).
For each granularity it times, back to back over all layers:

- ``ours``: ``weight_sync.quant.quantize_fp8`` (the Triton kernels on CUDA),
- ``torch``: the torch formulation, the definition of the bits (Triton disabled),
- the bound: one cast-copy ``q.copy_(w)`` per weight (read bf16 once, write fp8 once: the single-pass
  bound for block and channel scales); per-tensor scales need two reads, so their bound is that time
  x 5/3 (2 + 2 + 1 bytes per element instead of 2 + 1).

It checks ``ours`` bitwise against ``torch`` on the first layer's weights before timing.

    python benchmarks/bench_quant.py --device cuda --preset qwen3-8b --tag h200
    python benchmarks/bench_quant.py                        # CPU (the torch path only: no Triton)
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import env_markdown, environment, median, timed, write_results

from weight_sync.quant import fp8
from weight_sync.quant.fp8 import Fp8Config, quantize_fp8
from weight_sync.testing import hf_config

GRANULARITIES = ("tensor", "channel", "block")


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every fused linear of a Qwen3 config, layer by layer."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    return per_layer * cfg["num_hidden_layers"]


def scale_shape(shape: tuple[int, int], config: Fp8Config) -> tuple[int, ...]:
    """The fp32 scales ``quantize_fp8`` makes for a weight of ``shape``."""
    if config.granularity == "tensor":
        return (1,)
    if config.granularity == "channel":
        return (shape[0],)
    return tuple(-(-d // b) for d, b in zip(shape, config.block_size))


@contextlib.contextmanager
def torch_formulation() -> Iterator[None]:
    """Quantize with the torch path (the bits' definition) instead of the Triton kernels."""
    available = fp8.triton_available
    fp8.triton_available = lambda: False  # type: ignore[assignment]
    try:
        yield
    finally:
        fp8.triton_available = available  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="bench")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--granularities", default=",".join(GRANULARITIES))
    p.add_argument("--no-torch", action="store_true", help="skip timing the torch path (slow on big models)")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = hf_config("qwen3", args.preset)
    shapes = linear_shapes(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    weights = [(torch.randn(s, device=device, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)
               for s in shapes]
    qs = [torch.empty(s, dtype=torch.float8_e4m3fn, device=device) for s in shapes]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    numel = sum(w.numel() for w in weights)

    def cast_copy() -> None:
        for q, w in zip(qs, weights):
            q.copy_(w)

    bound_s = median(timed(cast_copy, device, args.repeats))
    print(f"{len(shapes)} linears, {nbytes / 1e9:.2f} GB bf16; cast-copy bound {bound_s * 1e3:.2f} ms "
          f"({3 * numel / bound_s / 1e9:.0f} GB/s)", flush=True)
    triton_on = fp8.triton_available()
    rows = []
    for gran in args.granularities.split(","):
        config = Fp8Config(granularity=gran)
        scales = [torch.empty(scale_shape(tuple(w.shape), config), dtype=torch.float32, device=device)
                  for w in weights]

        def ours(config=config, scales=scales) -> None:
            for q, s, w in zip(qs, scales, weights):
                quantize_fp8(w, config, out=(q, s))

        def torch_path(config=config, scales=scales) -> None:
            with torch_formulation():
                ours(config, scales)

        for w in weights[:4]:  # the bits are the torch path's
            a_q, a_s = quantize_fp8(w, config)
            with torch_formulation():
                b_q, b_s = quantize_fp8(w, config)
            if not (torch.equal(a_q.view(torch.uint8), b_q.view(torch.uint8)) and torch.equal(a_s, b_s)):
                raise SystemExit(f"{gran}: the fast path differs from the torch path on a {tuple(w.shape)} weight")
        ours_s = median(timed(ours, device, args.repeats))
        torch_s = None if args.no_torch else median(timed(torch_path, device, args.repeats))
        gran_bound = bound_s * (5 / 3 if gran == "tensor" else 1.0)
        row = {"granularity": gran, "ours_s": ours_s, "torch_s": torch_s, "bound_s": gran_bound,
               "ours_over_bound": ours_s / gran_bound, "triton": triton_on,
               "torch_over_ours": None if torch_s is None else torch_s / ours_s}
        rows.append(row)
        print(f"{gran:8s} ours {ours_s * 1e3:8.2f} ms = {row['ours_over_bound']:.2f}x its bound "
              f"({gran_bound * 1e3:.2f} ms)" + ("" if torch_s is None else f"; torch path {torch_s * 1e3:.2f} ms "
                                               f"({row['torch_over_ours']:.2f}x ours)"), flush=True)
    env = environment()
    tag = args.tag or device.type
    md = [f"# fp8 quantization benchmark ({tag})", "", env_markdown(env), "",
          f"Linears of the `{args.preset}` preset: {len(shapes)} weights, {nbytes / 1e9:.2f} GB bf16, quantized "
          f"into preallocated fp8 weights + fp32 scales. Bound: one bf16->fp8 cast-copy per weight "
          f"({bound_s * 1e3:.2f} ms; x5/3 for per-tensor scales, which need two reads). Medians of "
          f"{args.repeats}. Triton kernels: {'yes' if triton_on else 'no (torch path)'}. Bits checked equal to "
          f"the torch path on the first layer.", "",
          "| granularity | ours ms | bound ms | ours / bound | torch path ms | torch / ours |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        t = "-" if r["torch_s"] is None else f"{r['torch_s'] * 1e3:.2f}"
        tr = "-" if r["torch_over_ours"] is None else f"{r['torch_over_ours']:.2f}x"
        md.append(f"| {r['granularity']} | {r['ours_s'] * 1e3:.2f} | {r['bound_s'] * 1e3:.2f} | "
                  f"{r['ours_over_bound']:.2f}x | {t} | {tr} |")
    json_path, md_path = write_results(f"quant_{tag}", {"env": env, "preset": args.preset, "bytes": nbytes,
                                                        "cast_copy_s": bound_s, "rows": rows}, "\n".join(md) + "\n")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
