"""FP8 (e4m3) online quantization: per-tensor (the seed's example), per-output-channel, 128x128 blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.quant.base import layer_tensor
from weight_sync.quant.online import OnlineQuantLinearMethod, reduce_max

__all__ = [
    "FP8_MAX",
    "Fp8Config",
    "Fp8LinearMethod",
    "dequantize_fp8",
    "quantize_fp8",
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


def _f32_copy(t: torch.Tensor) -> torch.Tensor:
    # Always a copy: .float() on an fp32 tensor returns the tensor itself, and it is scaled in place.
    return t.to(torch.float32, copy=True)


def _absmax(t: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """max |t| in fp32 without materializing |t|: max(max, -min) is exact in every float dtype."""
    if dim is None:
        return torch.maximum(t.max(), -t.min()).float()
    return torch.maximum(t.amax(dim=dim), -t.amin(dim=dim)).float()


def quantize_fp8(
    w: torch.Tensor,
    config: Fp8Config,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to fp8 e4m3; returns (qweight, fp32 scale) with ``w ~= q * scale``.

    Peak temporary memory is one fp32 copy of the weight (scaled and clamped in place).
    """
    if w.dim() != 2:
        raise ConfigError(f"fp8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    if config.granularity == "tensor":
        amax = reduce_max(_absmax(w).reshape(1), group)
        scale = amax.clamp(min=_EPS) / FP8_MAX
        scaled = _f32_copy(w).div_(scale)
    elif config.granularity == "channel":
        scale = _absmax(w, 1).clamp(min=_EPS) / FP8_MAX
        scaled = _f32_copy(w).div_(scale[:, None])
    else:
        # Tiles are views of (at most) one padded copy; the scale broadcasts over each tile.
        tiles = _blocks(w, *config.block_size)
        scale = _absmax(tiles, (1, 3)).clamp(min=_EPS) / FP8_MAX
        scaled_tiles = _f32_copy(tiles).div_(scale[:, None, :, None])
        scaled = _unblock(scaled_tiles, (w.shape[0], w.shape[1]))
    q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize_fp8(
    q: torch.Tensor, scale: torch.Tensor, config: Fp8Config, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` (up to rounding), in ``dtype``."""
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
        self, weight: torch.Tensor, group: dist.ProcessGroup | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8(weight, self.config, group)

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
