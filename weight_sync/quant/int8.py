"""INT8 online quantization with one symmetric scale per output channel."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.quant.base import layer_tensor
from weight_sync.quant.online import OnlineQuantLinearMethod, RowBands, write_band

__all__ = ["Int8Config", "Int8LinearMethod", "dequantize_int8", "quantize_int8"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Int8Config:
    """Online int8 quantization of linear weights (per output channel, symmetric)."""

    granularity: Literal["channel"] = "channel"

    def __post_init__(self) -> None:
        if self.granularity != "channel":
            raise ConfigError(f"Int8Config.granularity must be 'channel', got {self.granularity!r}")


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight to int8 with one fp32 scale per row; ``w ~= q * scale[:, None]``."""
    if w.dim() != 2:
        raise ConfigError(f"int8 quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    # max(max, -min) avoids materializing |w|; one fp32 copy is scaled, rounded and clamped in place.
    scale = torch.maximum(w.amax(dim=1), -w.amin(dim=1)).float().clamp(min=1e-12) / 127.0
    scaled = w.to(torch.float32, copy=True).div_(scale[:, None])
    q = scaled.round_().clamp_(-128, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[:, None]).to(dtype)


class Int8LinearMethod(OnlineQuantLinearMethod):
    """Linear layers served from int8 weights (dequantized matmul)."""

    name = "int8_channel"

    def __init__(self, config: Int8Config) -> None:
        self.config = config

    def quantize(
        self,
        weight: torch.Tensor,
        group: dist.ProcessGroup | None,
        out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8(weight)  # new tensors (``out`` is a hint; reload copies them back)

    def row_bands(self, layer: nn.Module, name: str, shape: tuple[int, ...]) -> RowBands | None:
        q, s = layer._parameters.get("weight"), layer._parameters.get("weight_scale")
        if (name != "weight" or len(shape) != 2 or q is None or s is None or q.dtype != torch.int8
                or tuple(q.shape) != shape or tuple(s.shape) != shape[:1]):
            return None
        return RowBands(align=1, target=_int8_band_target, quantize=_int8_bands)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = layer_tensor(layer, "weight"), layer_tensor(layer, "weight_scale")
        return F.linear(x, dequantize_int8(q, scale, x.dtype), bias)


def _int8_band_target(layer: nn.Module, matrix: int, row: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    end = row + rows
    return (layer._parameters["weight"].detach()[row:end],  # type: ignore[union-attr]
            layer._parameters["weight_scale"].detach()[row:end])  # type: ignore[union-attr]


def _int8_bands(items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    for w, q, s in items:
        write_band(q, s, quantize_int8(w))
