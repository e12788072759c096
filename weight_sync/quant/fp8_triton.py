"""The fp8 scale-clamp-cast pass as one Triton kernel on CUDA: read the weight once, write fp8 once.

The torch formulation needs an fp32 intermediate (divide, clamp, cast: three kernels and ~23 bytes of
memory traffic per element); during a live update of a large fp8 engine that pass, not the wire, set
the pace. The kernel does the same arithmetic per element - the weight widened to fp32, an IEEE
round-to-nearest division by its fp32 scale, a NaN-propagating clamp to +-448, a round-to-nearest-even
cast to e4m3 - so its output is bitwise equal to the torch path (checked by a GPU test). Triton is
imported only when a CUDA weight is quantized, so ``import weight_sync`` never loads it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["scale_cast_fp8", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether the kernel can run here (Triton importable and a CUDA device present)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def scale_cast(w_ptr, q_ptr, s_ptr, n, k, stride_w, stride_q, s_row, s_col, bn, bk, fmax,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=mask, other=0.0)
        s = tl.load(s_ptr + (rows[:, None] // bn) * s_row + (cols[None, :] // bk) * s_col, mask=mask, other=1.0)
        x = tl.math.div_rn(w.to(tl.float32), s)
        x = tl.clamp(x, -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
        q = x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q, mask=mask)

    return scale_cast


def scale_cast_fp8(w: torch.Tensor, scale: torch.Tensor, granularity: str, block_size: tuple[int, int],
                   fmax: float) -> torch.Tensor:
    """fp8 e4m3 ``clamp(w / scale, -fmax, fmax)`` for a 2-D CUDA weight with unit column stride.

    ``scale`` is fp32: one element ('tensor'), one per row ('channel') or [row tiles, column tiles]
    ('block').
    """
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    if w.numel() == 0:
        return q
    s = scale.float().contiguous()
    if granularity == "tensor":
        bn, bk, s_row, s_col = 1, 1, 0, 0
    elif granularity == "channel":
        bn, bk, s_row, s_col = 1, 1, 1, 0
    else:
        (bn, bk), s_row, s_col = block_size, s.stride(0), s.stride(1)
    grid = (-(-n // 32), -(-k // 128))
    # Triton launches on the *current* device (and its current stream): a weight on another GPU than the
    # current one (an engine on cuda:1 built from a process whose current device is cuda:0) must switch.
    with torch.cuda.device(w.device):
        _kernel()[grid](w, q, s, n, k, w.stride(0), q.stride(0), s_row, s_col, bn, bk, fmax,
                        BLOCK_M=32, BLOCK_N=128)
    return q
