"""Linear methods: how a linear layer creates, processes and applies its weights (vLLM's convention).

``create_weights`` registers *model-format* parameters (full precision, fused, TP-sharded) that carry a
``weight_loader``; ``process_weights_after_loading`` turns them into *kernel format* (quantized weights
and scales); ``apply`` runs the matmul. ``requires_processing`` tells reload whether a layer can take the
direct path (checkpoint layout written straight into live storage) or must be buffered and processed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "LinearMethod",
    "UnquantizedLinearMethod",
    "layer_tensor",
    "make_weight_param",
]

WeightLoader = Callable[..., None]


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer.<name>`` as a tensor (typed: nn.Module attribute access is untyped)."""
    t = getattr(layer, name)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{type(layer).__name__}.{name} is {type(t).__name__}, expected a tensor")
    return t


def make_weight_param(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    weight_loader: WeightLoader | None,
    **attrs: Any,
) -> nn.Parameter:
    """A zero-filled Parameter with loader metadata attached (``weight_loader``, ``output_dim``, ...)."""
    p = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device), requires_grad=False)
    if weight_loader is not None:
        p.weight_loader = weight_loader  # type: ignore[attr-defined]
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class LinearMethod:
    """Base class: subclasses implement the three hooks; processing is off by default."""

    #: False when kernel format equals model format, so reload may write checkpoint data in place.
    requires_processing: bool = False
    #: Human-readable name used in reports and errors.
    name: str = "linear"
    #: True when ``process_weights_after_loading`` only reads the model-format tensors (never writes
    #: them, never keeps a reference): reload may then process tensors where they arrived (a transport
    #: bucket) instead of copying them into staging first.
    processor_reads_input: bool = False

    #: Where the model-format weight is created: None = the layer's device; "meta" = materialized
    #: layer by layer by the first load (online quantization never holds a full-precision model).
    model_format_device: str | None = None

    def create_weights(
        self,
        layer: nn.Module,
        *,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
        device: torch.device | str,
    ) -> None:
        """Register the model-format ``weight`` (rows = the fused output partitions) with its loader."""
        weight = make_weight_param(
            (sum(output_partition_sizes), input_size_per_partition),
            params_dtype,
            self.model_format_device or device,
            weight_loader,
            input_dim=1,
            output_dim=0,
        )
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn model-format tensors into kernel format (no-op for unquantized layers)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """Plain ``F.linear`` on a weight in the model's dtype; kernel format equals model format."""

    name = "unquantized"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer_tensor(layer, "weight"), bias)
