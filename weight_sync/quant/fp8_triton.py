"""fp8 e4m3 quantization kernels in Triton: read the weight from memory once (twice per tensor), write fp8 once.

The torch formulation needs an fp32 intermediate and separate reductions for the scales (amax, amin,
divide, clamp, cast: ~23 bytes of memory traffic per element plus two strided reads for the scales);
during a live update of a large fp8 engine that pass, not the wire, set the pace. The kernels:

- ``quantize_fp8_fused`` ('block' and 'channel'): each program owns whole scale groups (one tile, or
  a band of rows), reads them for their absmax and scale, writes the scale, then reads them again - from
  L2, or from registers when a group fits one step - and writes the fp8 values.
- ``absmax_bits_fp8`` + ``tensor_cast_fp8`` ('tensor', whose global scale needs a reduction first,
  possibly over a TP group): one read for the absmax, then one kernel that computes the scale and casts.
- ``scale_cast_fp8``: the scale-clamp-cast pass alone, for scales computed elsewhere.
- ``dequantize_fp8_triton``: the way back, for a forward from fp8 weights - each fp8 value widened to
  fp32 (exact), multiplied by its fp32 scale (one IEEE round to nearest) and rounded once into the
  compute dtype: the torch path's bits (``dequantize_fp8``) in one pass of 1 byte read and 2 written per
  element, where torch's broadcast multiply ran at a fraction of that speed (~1 ms per 227 MB DiT block).

Both do the torch path's arithmetic per element - the weight widened to fp32, an IEEE round-to-nearest
division by the fp32 scale, a NaN-propagating clamp to +-448, a round-to-nearest-even cast to e4m3 - so
their output is bitwise equal to it (GPU tests; the fused kernel also under Triton's CPU interpreter).
Triton is imported only when a kernel is first needed, so ``import weight_sync`` never loads it.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from typing import Any, NamedTuple

import torch

__all__ = [
    "FusedGeometry",
    "absmax_bits_fp8",
    "dequantize_fp8_triton",
    "fused_geometry",
    "fused_supported",
    "launch_table",
    "quantize_fp8_fused",
    "scale_cast_fp8",
    "tensor_cast_fp8",
    "triton_available",
]

# Launch shapes, tuned on an H200 over Qwen3-8B's linears (benchmarks/bench_quant.py; a bf16 -> fp8 cast
# copy of the same bytes is the bound): a 128x128 tile read as two 128x64 column steps by 8 warps - the
# absmax pass from HBM, the cast pass again from L2 - runs at 1.09x the bound, where the whole tile in
# registers (one program per SM pair) ran at 1.53x; per-channel scales are fastest with one row per program
# read in steps of 4096 columns by 4 warps (0.93x: the cast copy itself is not at peak). No FMA contraction
# (enable_fp_fusion): every float operation must round like torch's.
_TILE = 128 * 128
_BLOCK_STEP = _TILE // 2  # elements per column step of a 'block' tile
_ROW_STEP = 4096  # elements per program and column step of 'channel' rows


@functools.cache
def triton_available() -> bool:
    """Whether the kernels can run here (Triton importable and a CUDA device present)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def _launch_device(w: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The context to launch a kernel on ``w`` in."""
    # Triton launches on the *current* device (and its current stream): a weight on another GPU than the
    # current one (an engine on cuda:1 built from a process whose current device is cuda:0) must switch.
    # A CPU tensor only reaches a kernel under TRITON_INTERPRET=1 (the CPU tests).
    return torch.cuda.device(w.device) if w.is_cuda else contextlib.nullcontext()


def launch_table(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 tensor on ``device`` for a kernel to read (pointers, sizes of a grouped
    launch): copied from pinned memory without waiting, in stream order before the launch."""
    table = torch.tensor(rows, dtype=torch.int64)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


def _f32_bits(x: float) -> int:
    """The int32 bits of ``x`` rounded to fp32 (to nearest), as torch rounds the scalar of an fp32 clamp."""
    return int(struct.unpack("<i", struct.pack("<f", x))[0])


def _pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (Triton block shapes are powers of two)."""
    return 1 << max(x - 1, 0).bit_length()


@functools.cache
def _kernels() -> tuple[Any, Any, Any, Any]:
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

    @triton.jit
    def fused(w_ptr, q_ptr, s_ptr, n, k, stride_w, stride_q, group_rows, group_cols, col_groups, chunks,
              eps_bits, fmax, BM: tl.constexpr, BK: tl.constexpr, PER_ROW: tl.constexpr, ONE_PASS: tl.constexpr):
        # Program pid owns scale group (pid // col_groups, pid % col_groups): group_rows x group_cols
        # elements, read in `chunks` column steps of BK (ONE_PASS: one step, kept in registers). A 1-D
        # grid: no 65535 limit on either axis. (No helper functions: the interpreter cannot call jitted
        # closures.) Masked lanes - past the group, past the weight - read 0: the torch path's padding.
        # Absmax and clamp(min=eps) as int32 bits: those of a non-negative float order like the float, and
        # a NaN (sign cleared) sorts above inf, so integer maxima propagate NaN like torch's amax and clamp
        # - with no float comparison a compiler could turn into a NaN-dropping max.
        pid = tl.program_id(0)
        local = tl.arange(0, BM)
        rows = (pid // col_groups) * group_rows + local
        row_ok = (local < group_rows) & (rows < n)
        col0 = (pid % col_groups) * group_cols
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w + col0
        q_rows = q_ptr + rows[:, None].to(tl.int64) * stride_q + col0
        if ONE_PASS:
            cols = tl.arange(0, BK)
            mask = row_ok[:, None] & ((cols < group_cols) & (col0 + cols < k))[None, :]
            x = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        else:
            bits = tl.zeros([BM], dtype=tl.int32)
            for c in range(chunks):
                cols = c * BK + tl.arange(0, BK)
                mask = row_ok[:, None] & ((cols < group_cols) & (col0 + cols < k))[None, :]
                x = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                bits = tl.maximum(bits, tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
        if not PER_ROW:
            bits = tl.max(bits, axis=0)
        s = tl.math.div_rn(tl.maximum(bits, eps_bits).to(tl.float32, bitcast=True), fmax)
        if PER_ROW:
            tl.store(s_ptr + rows, s, mask=row_ok)
            s = s[:, None]
        else:
            tl.store(s_ptr + pid, s)
        if ONE_PASS:  # from registers: the one read of the weight
            x = tl.clamp(tl.math.div_rn(x, s), -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
            tl.store(q_rows + cols[None, :], x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)
        else:
            for c in range(chunks):
                cols = c * BK + tl.arange(0, BK)
                mask = row_ok[:, None] & ((cols < group_cols) & (col0 + cols < k))[None, :]
                x = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = tl.clamp(tl.math.div_rn(x, s), -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
                tl.store(q_rows + cols[None, :], x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                         mask=mask)

    @triton.jit
    def absmax_bits(w_ptr, out_ptr, n, k, stride_w, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # max |w| of one tile as int32 bits (see `fused`: they order like the floats, NaN above inf),
        # folded into the one result by an integer atomic max: one read of the weight, one launch.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=mask, other=0.0)
        bits = tl.max(tl.max(x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1), axis=0)
        tl.atomic_max(out_ptr, bits)

    @triton.jit
    def tensor_cast(w_ptr, q_ptr, bits_ptr, s_ptr, n, k, stride_w, stride_q, eps_bits, fmax,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # The per-tensor scale computed from the (group-reduced) absmax bits in every program - a scalar,
        # cheaper than a launch of its own - and stored once; then scale, clamp, cast as `scale_cast`.
        s = tl.math.div_rn(tl.maximum(tl.load(bits_ptr), eps_bits).to(tl.float32, bitcast=True), fmax)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(s_ptr, s)
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :], mask=mask, other=0.0)
        x = tl.clamp(tl.math.div_rn(w.to(tl.float32), s), -fmax, fmax, propagate_nan=tl.PropagateNan.ALL)
        q = x.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q, mask=mask)

    return scale_cast, fused, absmax_bits, tensor_cast


def absmax_bits_fp8(w: torch.Tensor) -> torch.Tensor:
    """max |w| of a non-empty 2-D weight (unit column stride) as the int32 bits of an fp32, shape (1,).

    Integer bits so a TP group can MAX-reduce them as they are (non-negative floats order like their
    bits; NaN, sign cleared, above inf: it propagates as torch's ``amax`` does). One read of ``w``.
    """
    n, k = w.shape
    bits = torch.zeros(1, dtype=torch.int32, device=w.device)
    with _launch_device(w):
        _kernels()[2][(-(-n // 64), -(-k // 256))](w, bits, n, k, w.stride(0), BLOCK_M=64, BLOCK_N=256,
                                                  num_warps=8)
    return bits


def tensor_cast_fp8(w: torch.Tensor, bits: torch.Tensor, fmax: float, eps: float,
                    out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 weight and fp32 scale (shape (1,)) of ``w`` from its absmax bits: ``clamp(absmax, eps) / fmax``
    and ``clamp(w / scale, -fmax, fmax)`` in one kernel. ``out`` as in :func:`quantize_fp8_fused`."""
    n, k = w.shape
    q = out[0] if out[0] is not None else torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    scale = out[1] if out[1] is not None else torch.empty(1, dtype=torch.float32, device=w.device)
    with _launch_device(w):
        _kernels()[3][(-(-n // 32), -(-k // 128))](w, q, bits, scale, n, k, w.stride(0), q.stride(0),
                                                   _f32_bits(eps), fmax, BLOCK_M=32, BLOCK_N=128,
                                                   enable_fp_fusion=False)
    return q, scale


def fused_supported(granularity: str, block_size: tuple[int, int]) -> bool:
    """Whether :func:`quantize_fp8_fused` handles this granularity (tiles up to ``_TILE`` rows tall)."""
    return granularity == "channel" or (granularity == "block" and _pow2(block_size[0]) <= _TILE)


def quantize_fp8_fused(w: torch.Tensor, granularity: str, block_size: tuple[int, int], fmax: float,
                       eps: float, out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weight and fp32 scales of a non-empty 2-D weight with unit column stride, one kernel.

    'block': scales [row tiles, column tiles]; 'channel': one per row. The scale of a group is
    ``clamp(absmax, eps) / fmax``; NaN anywhere in a group makes its scale and values NaN, as in torch.
    Allocates only the two outputs, or none: ``out`` = (q, scale) given by the caller, already checked to
    be contiguous with the right shape, dtype and device. CUDA, or CPU tensors under ``TRITON_INTERPRET=1``.
    """
    if not fused_supported(granularity, block_size) or w.dim() != 2 or w.stride(1) != 1 or w.numel() == 0:
        raise ValueError(f"fused fp8 needs a non-empty 2-D weight with unit column stride and a supported "
                         f"granularity, got {granularity!r} {block_size} {tuple(w.shape)} {w.stride()}")
    n, k = w.shape
    g = fused_geometry(n, k, granularity, block_size)
    if g.per_row:
        scale = out[1] if out[1] is not None else torch.empty(n, dtype=torch.float32, device=w.device)
    else:
        scale = out[1] if out[1] is not None else torch.empty(
            (-(-n // g.group_rows), g.col_groups), dtype=torch.float32, device=w.device)
    q = out[0] if out[0] is not None else torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    with _launch_device(w):
        _kernels()[1][(g.groups,)](w, q, scale, n, k, w.stride(0), q.stride(0), g.group_rows, g.group_cols,
                                   g.col_groups, g.chunks, _f32_bits(eps), fmax, BM=g.bm, BK=g.bk,
                                   PER_ROW=g.per_row, ONE_PASS=g.chunks == 1, num_warps=g.num_warps,
                                   enable_fp_fusion=False)
    return q, scale


class FusedGeometry(NamedTuple):
    """How the fused kernel splits an (n, k) weight: its scale groups and the program shape reading them."""

    per_row: bool
    group_rows: int
    group_cols: int
    col_groups: int
    groups: int
    bm: int
    bk: int
    chunks: int
    num_warps: int


@functools.lru_cache(maxsize=4096)
def fused_geometry(n: int, k: int, granularity: str, block_size: tuple[int, int]) -> FusedGeometry:
    """The fused kernel's split of an (n, k) weight (cached: a reload asks once per tensor)."""
    if granularity == "channel":  # a group is a band of bm rows, each with its own scale
        per_row, group_cols, col_groups = True, k, 1
        bk = min(_pow2(k), _ROW_STEP)
        bm = group_rows = max(1, min(_ROW_STEP // bk, _pow2(n)))
    else:
        per_row, (group_rows, group_cols) = False, block_size
        bm, col_groups = _pow2(group_rows), -(-k // group_cols)
        bk = min(_pow2(group_cols), max(1, _BLOCK_STEP // bm))
    return FusedGeometry(per_row, group_rows, group_cols, col_groups, -(-n // group_rows) * col_groups, bm, bk,
                         -(-group_cols // bk), 4 if per_row or bm * bk < _BLOCK_STEP else 8)


def _scale_layout(scale: torch.Tensor, granularity: str,
                  block_size: tuple[int, int]) -> tuple[torch.Tensor, int, int, int, int]:
    """(fp32 contiguous scales, tile rows, tile cols, row stride, col stride): element (r, c) of the weight
    takes ``s[(r // bn) * s_row + (c // bk) * s_col]``, for every granularity."""
    s = scale.float().contiguous()
    if granularity == "tensor":
        return s, 1, 1, 0, 0
    if granularity == "channel":
        return s, 1, 1, 1, 0
    return s, block_size[0], block_size[1], s.stride(0), s.stride(1)


def scale_cast_fp8(w: torch.Tensor, scale: torch.Tensor, granularity: str, block_size: tuple[int, int],
                   fmax: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp8 e4m3 ``clamp(w / scale, -fmax, fmax)`` for a 2-D weight with unit column stride.

    ``scale`` is fp32: one element ('tensor'), one per row ('channel') or [row tiles, column tiles]
    ('block'). ``out``: a contiguous fp8 (n, k) tensor on ``w``'s device to write into.
    """
    n, k = w.shape
    q = out if out is not None else torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    if w.numel() == 0:
        return q
    s, bn, bk, s_row, s_col = _scale_layout(scale, granularity, block_size)
    grid = (-(-n // 32), -(-k // 128))
    with _launch_device(w):
        _kernels()[0][grid](w, q, s, n, k, w.stride(0), q.stride(0), s_row, s_col, bn, bk, fmax,
                            BLOCK_M=32, BLOCK_N=128, enable_fp_fusion=False)
    return q


@functools.cache
def _dequant_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def dequant(q_ptr, s_ptr, o_ptr, n, k, stride_q, stride_o, s_row, s_col, bn, bk,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOWNCAST: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < n) & (cols[None, :] < k)
        x = tl.load(q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], mask=mask, other=0.0)
        s = tl.load(s_ptr + (rows[:, None] // bn) * s_row + (cols[None, :] // bk) * s_col, mask=mask, other=1.0)
        y = x.to(tl.float32) * s
        if DOWNCAST:
            y = y.to(o_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(o_ptr + rows[:, None].to(tl.int64) * stride_o + cols[None, :], y, mask=mask)

    return dequant


def dequantize_fp8_triton(q: torch.Tensor, scale: torch.Tensor, granularity: str, block_size: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """``(q.float() * scale).to(dtype)`` for a 2-D fp8 weight with unit column stride, in one kernel.

    ``scale`` is fp32, laid out as :func:`scale_cast_fp8` takes it; ``dtype`` is bf16, fp16 or fp32. Each
    element sees the torch path's operations (exact widening, one fp32 multiply, one rounding into
    ``dtype``), so the bytes are the same; ragged edge tiles need no padding (each element reads its
    own tile's scale).
    """
    n, k = q.shape
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    if q.numel() == 0:
        return out
    s, bn, bk, s_row, s_col = _scale_layout(scale, granularity, block_size)
    grid = (-(-n // 32), -(-k // 128))
    with _launch_device(q):
        _dequant_kernel()[grid](q, s, out, n, k, q.stride(0), out.stride(0), s_row, s_col, bn, bk,
                                BLOCK_M=32, BLOCK_N=128, DOWNCAST=dtype != torch.float32, enable_fp_fusion=False)
    return out
