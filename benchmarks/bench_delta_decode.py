"""Host cost per payload of the engine's batched delta decode: device payloads against the same bytes on the host.

Why: on one H100 the 8B fp8_block engine's delta apply spends most of its time in the batched decode's
header parse (``delta_batch.parse_many``: ~90 us of host time per payload under cProfile), where this
repository's CPU runs the same parse at ~18 us per payload. This benchmark isolates that work.

Method. The tensors of a ``make_checkpoint`` preset (bf16, on ``--device``) and a copy with a random
fraction ``d`` of every tensor's elements changed (one bit flipped) are encoded as the sender does
(``encode_deltas``) and staged as the engine holds them: one flat copy, a view per payload. Timed, median
over ``--repeats`` (the device synchronized around each):

- ``parse``: :func:`~weight_sync.transport.delta_batch.parse_many` of every payload (host work + one read);
- ``decode``: :func:`~weight_sync.transport.delta_batch.decode_together` + its checks read back;
- the same two on host copies of the payloads (the baseline: the same bytes, host tensors);
- ``views``: the bare torch work parse_many does on each payload (four region slices, two dtype views;
  not its two chunk-table slices, which are host tensors either way) on the device payloads and on the
  host copies: what a payload's views cost before any of our logic;
- ``staged``: the by-address decode of the same payloads from their flat copy by offset
  (``delta_staged.staged_tables`` + ``decode_staged`` + its checks read back; no view per payload), the
  decode an engine runs with ``WEIGHT_SYNC_DELTA_BY_ADDRESS=1``.

Ratios printed: device / host per payload for each, and staged / decode on each side. Results: ``benchmarks/results/delta_decode_<tag>.{json,md}``.

Usage: ``python benchmarks/bench_delta_decode.py --device cuda --preset qwen3-8b --densities 0,0.02``.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, median, timed, write_results
from weight_sync.testing.checkpoint import hf_config, random_weights
from weight_sync.transport.delta import encode_deltas, raise_failed
from weight_sync.transport.delta_batch import decode_together, parse_many
from weight_sync.transport.delta_staged import decodable, decode_staged, staged_tables

Item = tuple[torch.Tensor, int, torch.dtype]
ENCODE_BYTES = 1 << 30


def _staged(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[Item], torch.Tensor]:
    """The payloads as the engine holds them after ``InPlaceUpdate.stage``: views of one flat copy (and it).
    Encoded in groups of at most ``ENCODE_BYTES`` of tensors, as a sender encodes bucket by bucket (the
    encode's work memory is a few times its group's size)."""
    encoded, group, size = [], [], 0
    for new, old in pairs:
        group.append((new, old))
        size += new.numel() * new.element_size()
        if size >= ENCODE_BYTES:
            encoded += encode_deltas(group)
            group, size = [], 0
    encoded += encode_deltas(group) if group else []
    flat = torch.cat([enc for enc, _ in encoded])
    items, at = [], 0
    for (enc, _), (new, _) in zip(encoded, pairs):
        n = enc.numel()
        items.append((flat[at : at + n], new.numel(), new.dtype))
        at += n
    return items, flat


def _bare_views(items: list[Item]) -> None:
    """The views parse_many makes of each payload (four region slices, two dtype views), nothing else."""
    for payload, _, _ in items:
        n = payload.numel()
        q = n // 4 // 8 * 8
        payload[0:q], payload[q : 2 * q]
        payload[2 * q : 3 * q].view(torch.int16), payload[3 * q : n - n % 2].view(torch.int16)


def _decode(items: list[Item], dev: torch.device) -> None:
    checks: list[Any] = []
    decode_together(items, dev, checks)
    raise_failed(checks)


Layout = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _layout(items: list[Item]) -> Layout:
    """(offsets, sizes, numel, item size) of ``items`` laid back to back, as ``delta_flat.stage_call``
    records them when it stages a call (not part of the decode)."""
    sizes = np.fromiter((p.numel() for p, _, _ in items), dtype=np.int64, count=len(items))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    numel = np.fromiter((n for _, n, _ in items), dtype=np.int64, count=len(items))
    item = np.fromiter((d.itemsize for _, _, d in items), dtype=np.int64, count=len(items))
    return offsets, sizes, numel, item


def _decode_by_address(flat: torch.Tensor, layout: Layout) -> int:
    """The by-address decode of the payloads at ``layout`` in ``flat``; how many payloads it took (the
    others would take the view path)."""
    offsets, sizes, numel, item = layout
    tab = staged_tables(flat, offsets, sizes, numel, item)
    take = np.flatnonzero(decodable(tab, offsets))
    checks: list[Any] = []
    decode_staged(flat, offsets, tab, take, numel, checks)
    raise_failed(checks)
    return int(take.size)


def bench(device: str, preset: str, densities: list[float], repeats: int, seed: int) -> dict[str, Any]:
    dev = torch.device(device)
    cfg = hf_config("qwen3", preset)
    base = dict(random_weights(cfg, seed=seed, device=dev))
    g = torch.Generator(device=dev).manual_seed(seed + 1)
    rows = []
    for d in densities:
        pairs = []
        for t in base.values():
            new = t.clone()
            if d > 0:
                flip = torch.rand(t.shape, generator=g, device=dev) < d
                new.view(torch.int16)[flip] ^= 1
            pairs.append((new, t))
        items, flat = _staged(pairs)
        del pairs
        host = [(p.cpu(), n, dt) for p, n, dt in items]
        host_flat, layout = flat.cpu(), _layout(items)
        n = len(items)
        row: dict[str, Any] = {"density": d, "payloads": n, "payload_bytes": sum(p.numel() for p, _, _ in items),
                               "by_address": _decode_by_address(flat, layout)}
        for where, its, fl, on in (("device", items, flat, dev), ("host", host, host_flat, torch.device("cpu"))):
            for k, fn in (("parse", partial(parse_many, its)), ("decode", partial(_decode, its, on)),
                          ("views", partial(_bare_views, its)), ("staged", partial(_decode_by_address, fl, layout))):
                row[f"{where}_{k}_us"] = 1e6 * median(timed(fn, on, repeats)) / n
        for k in ("parse", "decode", "views", "staged"):
            row[f"{k}_ratio"] = row[f"device_{k}_us"] / row[f"host_{k}_us"]
        for where in ("device", "host"):
            row[f"{where}_staged_vs_decode"] = row[f"{where}_staged_us"] / row[f"{where}_decode_us"]
        rows.append(row)
        print(f"density {d:.1%}: {n} payloads, {row['payload_bytes'] / 1e6:.1f} MB; per payload (us) "
              f"parse {row['device_parse_us']:.1f} vs host {row['host_parse_us']:.1f} ({row['parse_ratio']:.2f}x), "
              f"decode {row['device_decode_us']:.1f} vs {row['host_decode_us']:.1f} ({row['decode_ratio']:.2f}x), "
              f"bare views {row['device_views_us']:.1f} vs {row['host_views_us']:.1f} ({row['views_ratio']:.2f}x), "
              f"by address {row['device_staged_us']:.1f} vs {row['host_staged_us']:.1f} "
              f"({row['device_staged_vs_decode']:.2f}x the decode on the device, {row['by_address']} of {n} "
              f"payloads taken)", flush=True)
        del items, host, flat, host_flat
    return {"device": device, "preset": preset, "repeats": repeats, "rows": rows, "environment": environment()}


def _markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    hw = env.get("gpu", "no GPU")
    lines = [
        f"# Batched delta decode, host cost per payload ({result['preset']}, payloads on {result['device']})",
        "",
        f"{env['date']}; {env['cpu']} ({env['cpu_count']} cores); {hw}; torch {env['torch']}, Python {env['python']}.",
        f"Command: `{env['command']}`. Median of {result['repeats']} runs after a warm-up, per payload.",
        "",
        "Baseline: the same payloads as host tensors. 'parse' = `delta_batch.parse_many` (header read and "
        "checks, region views); 'decode' = `decode_together` + its checks read back; 'bare views' = the "
        "slices and dtype views parse_many makes per payload and nothing else; 'by address' = "
        "`delta_staged.staged_tables` + `decode_staged` + its checks read back, from the flat copy by offset "
        "(no view per payload), and its time against 'decode' on the same side ('taken': payloads it decodes).",
        "",
        "| density | payloads | MB | parse us (host) | ratio | decode us (host) | ratio | bare views us (host) | ratio "
        "| by address us (host) | taken | by address / decode, device (host) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['density']:.1%} | {r['payloads']} | {r['payload_bytes'] / 1e6:.1f} | "
            f"{r['device_parse_us']:.1f} ({r['host_parse_us']:.1f}) | {r['parse_ratio']:.2f}x | "
            f"{r['device_decode_us']:.1f} ({r['host_decode_us']:.1f}) | {r['decode_ratio']:.2f}x | "
            f"{r['device_views_us']:.1f} ({r['host_views_us']:.1f}) | {r['views_ratio']:.2f}x | "
            f"{r['device_staged_us']:.1f} ({r['host_staged_us']:.1f}) | {r['by_address']} | "
            f"{r['device_staged_vs_decode']:.2f}x ({r['host_staged_vs_decode']:.2f}x) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--densities", default="0,0.02", help="comma-separated fractions of changed elements")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args(argv)
    densities = [float(x) for x in args.densities.split(",")]
    if any(not 0 <= d <= 1 for d in densities) or args.repeats < 1:
        ap.error(f"densities must lie in [0, 1] and repeats be >= 1, got {densities} and {args.repeats}")
    result = bench(args.device, args.preset, densities, args.repeats, args.seed)
    tag = args.tag or f"{args.device}_{args.preset}"
    j, m = write_results(f"delta_decode_{tag}", result, _markdown(result))
    print(f"wrote {j} and {m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
