"""FP8 (e4m3) online quantization: per-tensor (the seed's example), per-output-channel, 128x128 blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.quant.base import layer_tensor
from weight_sync.quant.fp8_triton import (
    absmax_bits_fp8,
    dequantize_fp8_triton,
    fused_supported,
    quantize_fp8_fused,
    scale_cast_fp8,
    tensor_cast_fp8,
    triton_available,
)
from weight_sync.quant.online import (
    OnlineQuantLinearMethod,
    RowBands,
    fitting_output,
    reduce_max,
    split_over_group,
    write_band,
)

__all__ = [
    "FP8_MAX",
    "Fp8Config",
    "Fp8LinearMethod",
    "dequantize_fp8",
    "quantize_fp8",
    "quantize_fp8_bands",
    "quantize_fp8_matrix_bands",
    "tabled_fp8_bands",
]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_EPS = 1e-12


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Config:
    """Online fp8 e4m3 quantization of linear weights.

    granularity: 'tensor' (one scale per weight, MAX-reduced over TP), 'channel' (one per output row) or
    'block' (one per ``block_size`` tile). use_scaled_mm: on CUDA, run tensor/channel scales through
    ``torch._scaled_mm`` with dynamically quantized activations; otherwise dequantize and matmul.
    """

    granularity: Literal["tensor", "channel", "block"] = "tensor"
    block_size: tuple[int, int] = (128, 128)
    use_scaled_mm: bool = True

    def __post_init__(self) -> None:
        if self.granularity not in ("tensor", "channel", "block"):
            raise ConfigError(
                f"Fp8Config.granularity must be 'tensor', 'channel' or 'block', got {self.granularity!r}"
            )
        if len(self.block_size) != 2 or min(self.block_size) < 1:
            raise ConfigError(f"Fp8Config.block_size must be two positive ints, got {self.block_size!r}")


def _blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """``w`` zero-padded to whole tiles (a copy only when padding is needed), viewed as
    (row tiles, bn, col tiles, bk), in ``w``'s dtype."""
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    if (nb * bn, kb * bk) != (n, k):
        w = F.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    return w.reshape(nb, bn, kb, bk)


def _unblock(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    nb, bn, kb, bk = t.shape
    return t.reshape(nb * bn, kb * bk)[: shape[0], : shape[1]]


# fp32 scratch per chunk of rows: bounds the temporary memory of quantizing a weight during a live update
# (a whole fp32 copy of a fused gate_up projection is twice its bf16 size on top of everything else)
# while keeping the number of kernel launches per weight small.
_CHUNK_BYTES = 64 << 20


def _absmax(t: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """max |t| in fp32 without materializing |t|: max(max, -min) is exact in every float dtype."""
    if dim is None:
        return torch.maximum(t.max(), -t.min()).float()
    return torch.maximum(t.amax(dim=dim), -t.amin(dim=dim)).float()


def _scale(absmax: torch.Tensor) -> torch.Tensor:
    """fp32 scales ``clamp(absmax, 1e-12) / 448``, a correctly rounded division on every device.

    ``t / 448.0`` is not one on CUDA: ATen computes a tensor divided by a CPU scalar as ``t * (1 / 448)``,
    which differs from the division in the last bit for about half of all inputs. A 0-dim divisor on
    ``t``'s device takes the ordinary division path, so CPU, CUDA and the Triton kernels agree.
    """
    return absmax.clamp(min=_EPS).div_(absmax.new_full((), FP8_MAX))


def _scaled_rows(w: torch.Tensor, r0: int, scale: torch.Tensor, config: Fp8Config, out: torch.Tensor) -> None:
    """``out`` (fp32, the shape of ``w``) = rows ``r0..`` of the weight divided by their scales.

    One kernel: dividing the low-precision rows by an fp32 scale into an fp32 ``out`` computes in fp32,
    exactly as converting first and dividing after, without the intermediate copy.
    """
    if config.granularity == "tensor":
        torch.div(w, scale, out=out)
    elif config.granularity == "channel":
        torch.div(w, scale[r0 : r0 + w.shape[0], None], out=out)
    else:
        bn, bk = config.block_size
        rows, cols = w.shape
        s = scale[r0 // bn : -(-(r0 + rows) // bn)][:, None, :, None]
        if rows % bn == 0 and cols % bk == 0:
            torch.div(w.reshape(rows // bn, bn, cols // bk, bk), s, out=out.view(rows // bn, bn, cols // bk, bk))
        else:  # a ragged edge: divide a zero-padded copy, tile by tile
            out.copy_(_unblock(_blocks(w.float(), bn, bk).div_(s), (rows, cols)))


def quantize_fp8(
    w: torch.Tensor,
    config: Fp8Config,
    group: dist.ProcessGroup | None = None,
    out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to fp8 e4m3; returns (qweight, fp32 scale) with ``w ~= q * scale``.

    The scales come from one pass over ``w``; the values are then scaled, clamped and cast in chunks of
    rows (whole tiles for 'block'), so the temporary memory is one 64 MB fp32 chunk, not an fp32 copy
    of the weight. Every element sees the same operations as an unchunked quantization: bitwise equal.
    On CUDA with Triton the same arithmetic runs in Triton (``fp8_triton``), bitwise equal again (a NaN
    may differ in sign, which torch itself leaves unspecified): 'block' and 'channel' as one kernel that
    reads the weight once, 'tensor' as an absmax kernel (its result MAX-reduced over ``group``) and a
    cast kernel that also computes the scale: two reads.

    ``out`` = (qweight, scale) tensors to write into, each used (and returned) only if it fits
    (:func:`~weight_sync.quant.online.fitting_output`); a reload passes the live kernel tensors.
    """
    if w.dim() != 2:
        raise ConfigError(f"fp8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    q_out = out[0] if fitting_output(out[0], w, (n, k), torch.float8_e4m3fn) else None
    s_out = out[1]
    fast = w.is_cuda and w.stride(1) == 1 and w.numel() > 0 and triton_available()
    if fast and fused_supported(config.granularity, config.block_size):
        s_shape = (n,) if config.granularity == "channel" else _tile_grid(n, k, config.block_size)
        s_fit = s_out if fitting_output(s_out, w, s_shape, torch.float32) else None
        return quantize_fp8_fused(w, config.granularity, config.block_size, FP8_MAX, _EPS, out=(q_out, s_fit))
    if fast and config.granularity == "tensor":
        # Two reads of the weight (absmax, then cast), the scale computed inside the cast kernel: the
        # torch path reads it three times (max, min, cast) and launches five more small kernels.
        s_fit = s_out if fitting_output(s_out, w, (1,), torch.float32) else None
        bits = reduce_max(absmax_bits_fp8(w), group)
        return tensor_cast_fp8(w, bits, FP8_MAX, _EPS, out=(q_out, s_fit))
    if config.granularity == "tensor":
        scale = _scale(reduce_max(_absmax(w).reshape(1), group))
    elif config.granularity == "channel":
        scale = _scale(_absmax(w, 1))
    else:
        # Tiles are views of (at most) one padded copy; one scale per tile.
        scale = _scale(_absmax(_blocks(w, *config.block_size), (1, 3)))
    scale = scale.contiguous()
    if fitting_output(s_out, w, tuple(scale.shape), torch.float32):
        assert s_out is not None
        scale = s_out.copy_(scale)
    if fast:
        return scale_cast_fp8(w, scale, config.granularity, config.block_size, FP8_MAX, out=q_out), scale
    q = q_out if q_out is not None else torch.empty((n, k), dtype=torch.float8_e4m3fn, device=w.device)
    _cast_rows(w, scale, config, q)
    return q, scale


def _cast_rows(w: torch.Tensor, scale: torch.Tensor, config: Fp8Config, q: torch.Tensor) -> None:
    """``q`` (fp8, the shape of ``w``) = ``w`` divided by its ``scale``, clamped and cast (the torch path),
    in chunks of rows - whole tiles for 'block' - so the temporary memory is one 64 MB fp32 chunk."""
    n, k = w.shape
    step = config.block_size[0] if config.granularity == "block" else 1
    rows = max(step, _CHUNK_BYTES // (4 * max(k, 1)) // step * step)
    if rows >= n:
        # One chunk (every weight up to 64 MB in fp32, e.g. each expert of a per-unit reload): the same
        # operations without the slicing, which costs more host time than the kernels of a small weight.
        chunk = torch.empty((n, k), dtype=torch.float32, device=w.device)
        _scaled_rows(w, 0, scale, config, chunk)
        q.copy_(chunk.clamp_(-FP8_MAX, FP8_MAX))
        return
    scratch = torch.empty(min(rows, n) * k, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, rows):
        part = w[r0 : r0 + rows]
        chunk = scratch[: part.numel()].view(part.shape)
        _scaled_rows(part, r0, scale, config, chunk)
        q[r0 : r0 + rows].copy_(chunk.clamp_(-FP8_MAX, FP8_MAX))


def quantize_fp8_bands(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], config: Fp8Config) -> None:
    """:func:`quantize_fp8` of each ``(w, q, s)`` into ``q`` / ``s`` ('channel' or 'block' scales).

    On CUDA with Triton the weights the fused kernel takes go through one grouped launch per kernel
    shape (:func:`~weight_sync.quant.fp8_grouped.quantize_fp8_grouped`, bitwise the same bytes);
    the rest, and every weight elsewhere, one by one.
    """
    if config.granularity == "tensor":
        raise ConfigError("per-tensor fp8 scales need the whole tensor: they cannot be quantized in bands")
    rest = items
    if items and items[0][0].is_cuda and triton_available() and fused_supported(config.granularity, config.block_size):
        from weight_sync.quant.fp8_grouped import quantize_fp8_grouped

        device = items[0][0].device
        grouped: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        rest = []
        for it in items:
            fits = (it[0].numel() and it[0].stride(1) == 1 and it[0].device == device
                    and it[1].is_contiguous() and it[2].is_contiguous())
            (grouped if fits else rest).append(it)
        quantize_fp8_grouped(grouped, config.granularity, config.block_size, FP8_MAX, _EPS)
    for w, q, s in rest:
        write_band(q, s, quantize_fp8(w, config, None, out=(q, s)))


def tabled_fp8_bands(targets: list[tuple[torch.Tensor, torch.Tensor]], shapes: list[tuple[int, int]],
                     dtype: torch.dtype, config: Fp8Config) -> Any:
    """:func:`quantize_fp8_bands` into fixed ``targets`` for sources of ``shapes`` and ``dtype``, made
    ready once (a :class:`~weight_sync.quant.fp8_grouped.GroupedBands`), or None where the bands would
    not all take the grouped kernel (off CUDA, no Triton, a configuration it does not take, a target
    that is not contiguous)."""
    if not (targets and targets[0][0].is_cuda and triton_available()
            and fused_supported(config.granularity, config.block_size)):
        return None
    device = targets[0][0].device
    if not all(q.is_contiguous() and s.is_contiguous() and q.device == device for q, s in targets):
        return None
    if any(n == 0 or k == 0 for n, k in shapes):
        return None
    from weight_sync.quant.fp8_grouped import GroupedBands

    return GroupedBands(targets, shapes, dtype, config.granularity, config.block_size, FP8_MAX, _EPS)


# (granularity, block size) -> the (quantize, table) pair of RowBands for it (see band_functions).
_BAND_FUNCTIONS: dict[tuple[str, tuple[int, ...]], tuple[Callable[..., None], Callable[..., Any]]] = {}


def band_functions(config: Fp8Config) -> tuple[Callable[..., None], Callable[..., Any]]:
    """``RowBands.quantize`` and ``RowBands.table`` for block or channel scales of ``config``.

    One pair per granularity and block size (all the band kernels read of a configuration): reload
    batches the bands of equal ``quantize`` callables, and every layer has its own method object, so
    bound methods would split a bucket's bands into one launch per layer tensor (~4 per decoder layer)
    where one per kernel shape does.
    """
    key = (config.granularity, tuple(config.block_size))
    fns = _BAND_FUNCTIONS.get(key)
    if fns is None:
        def quantize(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
            quantize_fp8_bands(items, config)

        def table(targets: list[tuple[torch.Tensor, torch.Tensor]], shapes: list[tuple[int, int]],
                  dtype: torch.dtype) -> Any:
            return tabled_fp8_bands(targets, shapes, dtype, config)

        fns = _BAND_FUNCTIONS[key] = (quantize, table)
    return fns


def tabled_fp8_matrix_bands(targets: list[tuple[torch.Tensor, torch.Tensor]], shapes: list[tuple[int, int]],
                            dtype: torch.dtype) -> Any:
    """:func:`quantize_fp8_matrix_bands` into fixed ``targets`` (every band of each one-scale matrix) for
    sources of ``shapes`` and ``dtype``, made ready once (a
    :class:`~weight_sync.quant.fp8_grouped.GroupedMatrices`), or None where the bands would not take the
    grouped kernels (off CUDA, no Triton, a target row view without unit column stride, an empty band)."""
    if not (targets and targets[0][0].is_cuda and triton_available()):
        return None
    device = targets[0][0].device
    if not all(q.stride(1) == 1 and q.device == device for q, _ in targets) or any(n == 0 or k == 0 for n, k in shapes):
        return None
    from weight_sync.quant.fp8_grouped import GroupedMatrices

    return GroupedMatrices(targets, shapes, dtype, FP8_MAX, _EPS)


_PER_TENSOR = Fp8Config(granularity="tensor")


def quantize_fp8_matrix_bands(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Per-tensor :func:`quantize_fp8` of whole matrices given as bands ``(w, q, s)``, grouped by ``s``.

    The bands sharing a one-element scale view ``s`` are every row of one matrix (q, k and v of a fused
    qkv; an expert's gate and up halves): their absmax is reduced first - max is exact in any order,
    so it is the fused matrix's - then each band is scaled, clamped and cast into its ``q`` rows with
    the matrix's scale: the bytes quantizing the fused matrix gives, without staging it. On CUDA with
    Triton the matrices of one call go out as two grouped launches (absmax, cast:
    :func:`~weight_sync.quant.fp8_grouped.quantize_fp8_matrices_grouped`), elsewhere through the
    torch path. No TP reduction: layers split over a group are staged and processed whole.
    """
    matrices: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for it in items:
        m = matrices.get(it[2].data_ptr())
        if m is None:
            matrices[it[2].data_ptr()] = [it]
        else:
            m.append(it)
    rest = list(matrices.values())
    first = items[0][0] if items else None
    if first is not None and first.is_cuda and triton_available():
        from weight_sync.quant.fp8_grouped import quantize_fp8_matrices_grouped

        grouped: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
        rest = []
        for bands in matrices.values():
            fits = all(w.device == first.device and w.dtype == first.dtype and w.stride(1) == 1 and w.numel()
                       and q.stride(1) == 1 for w, q, _ in bands)
            (grouped if fits else rest).append(bands)
        quantize_fp8_matrices_grouped(grouped, FP8_MAX, _EPS)
    for bands in rest:
        s = bands[0][2]
        absmax = _absmax(bands[0][0])
        for w, _, _ in bands[1:]:
            absmax = torch.maximum(absmax, _absmax(w))
        scale = s.copy_(_scale(absmax.reshape(1)))
        for w, q, _ in bands:
            _cast_rows(w, scale, _PER_TENSOR, q)


def _tile_grid(n: int, k: int, block_size: tuple[int, int]) -> tuple[int, int]:
    """Shape of the 'block' scales of an (n, k) weight: [row tiles, column tiles]."""
    return -(-n // block_size[0]), -(-k // block_size[1])


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, config: Fp8Config, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` (up to rounding), in ``dtype``: ``(q.float() * scale).to(dtype)``.

    Into bf16 or fp16 it runs in two passes instead of three: ``q.to(dtype)`` is exact (every e4m3 value
    is representable: 3 mantissa bits, exponents -9..8), and ``torch.mul(wide, scale, out=...)`` forms
    each product in fp32 (the scales are fp32: type promotion computes in fp32) and rounds it once into
    ``dtype``, as ``.to(dtype)`` does - bitwise the same weight with ~7 instead of ~15 bytes of memory
    traffic per element and no fp32 transient, which is what an fp8-streamed offload's blocks spend
    their device time on beyond the copy. Ragged edge tiles and other dtypes take the fp32 path.
    On CUDA with Triton one kernel does it (:func:`~weight_sync.quant.fp8_triton.dequantize_fp8_triton`:
    3 bytes of traffic per element, the same bits).
    """
    n, k = q.shape
    if (q.is_cuda and q.dtype == torch.float8_e4m3fn and dtype in (torch.bfloat16, torch.float16, torch.float32)
            and q.stride(1) == 1 and triton_available()):
        return dequantize_fp8_triton(q, scale, config.granularity, config.block_size, dtype)
    bn, bk = config.block_size
    ragged = config.granularity == "block" and bool(n % bn or k % bk)
    if q.dtype == torch.float8_e4m3fn and dtype in (torch.bfloat16, torch.float16) and not ragged:
        wide = q.to(dtype)
        out = torch.empty((n, k), dtype=dtype, device=q.device)
        if config.granularity == "tensor":
            torch.mul(wide, scale, out=out)
        elif config.granularity == "channel":
            torch.mul(wide, scale[:, None], out=out)
        else:
            torch.mul(wide.view(n // bn, bn, k // bk, bk), scale[:, None, :, None],
                      out=out.view(n // bn, bn, k // bk, bk))
        return out
    if config.granularity == "tensor":
        return (q.float() * scale).to(dtype)
    if config.granularity == "channel":
        return (q.float() * scale[:, None]).to(dtype)
    tiles = _blocks(q.float(), *config.block_size)
    return _unblock(tiles.mul_(scale[:, None, :, None]), (q.shape[0], q.shape[1])).to(dtype)


class Fp8LinearMethod(OnlineQuantLinearMethod):
    """Linear layers served from fp8 weights quantized online from a full-precision checkpoint."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.name = f"fp8_{config.granularity}"

    def quantize(
        self,
        weight: torch.Tensor,
        group: dist.ProcessGroup | None,
        out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(weight, self.config, group, out)

    def row_bands(self, layer: nn.Module, name: str, shape: tuple[int, ...]) -> RowBands | None:
        if name != "weight" or len(shape) != 2:
            return None
        granularity = self.config.granularity
        if granularity == "tensor" and split_over_group(getattr(layer, "tp_group", None)):
            return None  # its scale is MAX-reduced over the group: processed whole, in stream order
        q, s = layer._parameters.get("weight"), layer._parameters.get("weight_scale")
        scale_shape = {"tensor": (1,), "channel": (shape[0],)}.get(granularity) or _tile_grid(*shape, self.config.block_size)
        if (q is None or s is None or q.dtype != torch.float8_e4m3fn or tuple(q.shape) != shape
                or not q.is_contiguous() or tuple(s.shape) != scale_shape or not s.is_contiguous()):
            return None
        if granularity == "tensor":
            return RowBands(align=1, target=self._band_target, quantize=quantize_fp8_matrix_bands,
                            matrix_rows=shape[0], table=tabled_fp8_matrix_bands)
        quantize, table = band_functions(self.config)
        return RowBands(align=self.config.block_size[0] if granularity == "block" else 1,
                        target=self._band_target, quantize=quantize, table=table)

    def _band_target(self, layer: nn.Module, matrix: int, row: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = row + rows
        q = layer._parameters["weight"].detach()[row:end]  # type: ignore[union-attr]
        s = layer._parameters["weight_scale"].detach()  # type: ignore[union-attr]
        if self.config.granularity == "tensor":
            return q, s
        bn = self.config.block_size[0]
        return q, (s[row:end] if self.config.granularity == "channel" else s[row // bn : -(-end // bn)])

    def quantize_bands(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Quantize each (src, q, s) into its views (one grouped launch on CUDA)."""
        quantize_fp8_bands(items, self.config)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = layer_tensor(layer, "weight"), layer_tensor(layer, "weight_scale")
        n, k = q.shape
        if (
            x.is_cuda
            and self.config.use_scaled_mm
            and self.config.granularity != "block"
            and n % 16 == 0
            and k % 16 == 0
            and x.dtype == torch.bfloat16
        ):
            return _scaled_mm_linear(x, q, scale, bias, per_channel=self.config.granularity == "channel")
        return F.linear(x, dequantize_fp8(q, scale, self.config, x.dtype), bias)


def _scaled_mm_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, *, per_channel: bool
) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if per_channel:
        xs = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=_EPS) / FP8_MAX
        ws = scale.view(1, -1)
    else:
        xs = x2.abs().amax().float().clamp(min=_EPS).reshape(()) / FP8_MAX
        ws = scale.reshape(())
    xq = (x2.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=ws, bias=bias, out_dtype=x.dtype)
    return out.reshape(*shape[:-1], q.shape[0])
