"""Weights and a bit-level comparison shared by the fp8 kernel tests (CPU interpreter and GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from weight_sync.quant.fp8 import Fp8Config, quantize_fp8

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Whole tiles, ragged edges in both dimensions, a single short row, one past a tile in both.
SHAPES = [(256, 384), (200, 300), (1, 5), (129, 129)]
# (granularity, block_size); (256, 128) tiles take the fused kernel's two-pass loop (over 128x128
# elements), (100, 50) tiles are not powers of two.
CONFIGS = [("block", (128, 128)), ("block", (64, 32)), ("channel", (128, 128))]
SPECIAL_CONFIGS = [*CONFIGS, ("block", (256, 128)), ("block", (100, 50))]


def random_weight(shape: tuple[int, int], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """Normal values, a third of the rows 1000x smaller (small scales, values far below e4m3's range)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 5
    w[: shape[0] // 3] *= 1e-3
    return w.to(dtype).to(device)


def special_weight(shape: tuple[int, int], dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    """A weight (at least 200x300) with NaN, +-inf, -0.0, subnormals and the dtype's huge values.

    For 128x128 tiles of a 200x300 weight: tile (0, 2) holds only subnormals (and zeros), tile (1, 2)
    only zeros of both signs, tile (1, 0) values up to the dtype's max and a few subnormals; tiles
    (0, 0) and (1, 2)'s last element hold a NaN, tile (0, 1) both infinities, tile (1, 1) +inf.
    """
    n, k = shape
    assert n >= 200 and k >= 300, shape
    g = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    w = torch.randn(shape, generator=g) * 3
    w[:128, 256:] = torch.randint(-8, 8, (128, k - 256), generator=g) * (fi.smallest_normal / 16)
    w[128:, 256:] = 0.0
    w[128:, 257::2] = -0.0
    w[128:, :128] = (torch.rand(n - 128, 128, generator=g) * 2 - 1) * fi.max
    w[129, 1:4] = torch.tensor([1.0, -3.0, 5.0]) * (fi.smallest_normal / 8)
    w = w.to(dtype)
    w[3, 7] = w[n - 1, k - 1] = float("nan")
    w[5, 140] = w[70, 151] = -float("inf")
    w[70, 150] = w[150, 200] = float("inf")
    w[10, 10] = -0.0
    return w.to(device)


def torch_path(w: torch.Tensor, config: Fp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8`` without Triton: the reference."""
    from weight_sync.quant import fp8

    available = fp8.triton_available
    fp8.triton_available = lambda: False  # type: ignore[assignment]
    try:
        return quantize_fp8(w, config)
    finally:
        fp8.triton_available = available  # type: ignore[assignment]


def assert_same_bits(q: torch.Tensor, scale: torch.Tensor, ref_q: torch.Tensor, ref_scale: torch.Tensor,
                     what: object) -> None:
    """Equal fp8 bytes and fp32 scale bits, NaN at the same places (for a NaN, not its sign or payload).

    torch leaves a NaN's sign unspecified: on CPU its vectorized ``maximum`` returns an all-ones NaN and
    its scalar one a positive NaN, so the torch path itself gives either sign depending on the size.
    Every non-NaN value must match bit for bit (zeros' signs included).
    """
    assert q.dtype == ref_q.dtype == torch.float8_e4m3fn and q.shape == ref_q.shape, what
    assert scale.dtype == ref_scale.dtype == torch.float32 and scale.shape == ref_scale.shape, what
    qb, rb = q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu()
    q_nan, r_nan = (qb & 0x7F) == 0x7F, (rb & 0x7F) == 0x7F
    assert torch.equal(q_nan, r_nan), (what, "NaN positions of q differ", int((q_nan != r_nan).sum()))
    bad = qb[~q_nan] != rb[~r_nan]
    assert not bad.any(), (what, f"{int(bad.sum())} of {qb.numel()} fp8 bytes differ")
    s, rs = scale.cpu(), ref_scale.cpu()
    assert torch.equal(s.isnan(), rs.isnan()), (what, "NaN scales differ", s, rs)
    ok = ~s.isnan()
    assert torch.equal(s[ok].view(torch.int32), rs[ok].view(torch.int32)), (what, "scale bits differ")


def run_interpreted(child: str, cases: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run the script ``child`` under ``TRITON_INTERPRET=1`` in a child process (the flag must be set before
    a kernel is decorated) on ``cases`` saved to ``tmp``; returns what it saved. The script reads
    ``sys.argv[1]`` and writes ``sys.argv[2]``."""
    torch.save(cases, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", child, str(tmp / "in.pt"), str(tmp / "out.pt")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, Any] = torch.load(tmp / "out.pt")
    return result
