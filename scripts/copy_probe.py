"""How fast a reload's many small device copies can go: one ``copy_`` each, ``torch._foreach_copy_``,
weight_sync's grouped Triton copy, and one contiguous copy of the same bytes (the bound), same run.

The default workload is the expert slices of Qwen3-30B-A3B's fused experts for 16 layers (128 experts x
gate, up, down of 768 x 2048 bf16: 6144 copies of 3 MB into views of fused ``[E, 2I, H]`` / ``[E, H, I]``
tensors). Diagnostic (no result file): prints device and wall time of each way and the ratio to the bound.

    python scripts/copy_probe.py [--layers 16] [--experts 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from profile_reload_gpu import cuda_ms as timed  # scripts/ is this script's first path entry

from weight_sync.reload.grouped_copy import copy_many


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--groups", default="1,48,384", help="copies per call of the grouped ways")
    p.add_argument("--order", default="block", choices=("block", "interleaved"))
    p.add_argument("--ways", default="", help="only the ways whose name contains one of these (comma-separated)")
    args = p.parse_args()
    E, H, F = args.experts, args.hidden, args.inter
    bf = torch.bfloat16
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for _ in range(args.layers):
        w13 = torch.empty(E, 2 * F, H, dtype=bf, device="cuda")
        w2 = torch.empty(E, H, F, dtype=bf, device="cuda")
        for e in range(E):
            dst += [w13[e, :F], w13[e, F:], w2[e]]
            src += [torch.randn(F, H, dtype=bf, device="cuda"), torch.randn(F, H, dtype=bf, device="cuda"),
                    torch.randn(H, F, dtype=bf, device="cuda")]
    if args.order == "interleaved":  # per layer: every expert's gate, then every up, then every down
        per = 3 * E
        dst = [d for i in range(0, len(dst), per) for k in range(3) for d in dst[i + k:i + per:3]]
        src = [t for i in range(0, len(src), per) for k in range(3) for t in src[i + k:i + per:3]]
    nbytes = sum(t.nbytes for t in src)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    print(f"{len(src)} copies of {src[0].nbytes / 2**20:.1f} MiB, {nbytes / 1e9:.2f} GB; "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    bound_dev, bound_wall = timed(lambda: flat_dst.copy_(flat_src), args.repeats)
    print(f"  one contiguous copy (bound): device {bound_dev:.2f} ms, wall {bound_wall:.2f} ms, "
          f"{2 * nbytes / bound_dev / 1e6:.0f} GB/s read+write", flush=True)

    def loop() -> None:
        for d, s in zip(dst, src):
            d.copy_(s)

    ways: dict[str, Callable[[], None]] = {"copy_ each": loop}
    for g in (int(x) for x in args.groups.split(",")):
        def foreach(g: int = g) -> None:
            for i in range(0, len(dst), g):
                torch._foreach_copy_(dst[i:i + g], src[i:i + g])

        def grouped(g: int = g) -> None:
            for i in range(0, len(dst), g):
                copy_many(dst[i:i + g], src[i:i + g])

        ways[f"_foreach_copy_ x{g}"] = foreach
        ways[f"copy_many x{g}"] = grouped
    ways["_foreach_copy_ all"] = lambda: torch._foreach_copy_(dst, src)
    ways["copy_many all"] = lambda: copy_many(dst, src)
    keep = [w for w in args.ways.split(",") if w]
    for name, fn in ways.items():
        if keep and not any(k in name for k in keep):
            continue
        dev, wall = timed(fn, args.repeats)
        print(f"  {name:22s} device {dev:7.2f} ms ({dev / bound_dev:.2f}x), wall {wall:7.2f} ms "
              f"({wall / bound_dev:.2f}x), {wall * 1e3 / len(dst):.2f} us/copy host", flush=True)
    for d, s in zip(dst[:50], src[:50]):
        assert torch.equal(d, s)
    copy_many(dst, [s.neg() for s in src])
    assert all(torch.equal(d, s.neg()) for d, s in zip(dst[::97], src[::97])), "copy_many wrote other bytes"
    print("  copy_many result equal to the sources", flush=True)


if __name__ == "__main__":
    main()
