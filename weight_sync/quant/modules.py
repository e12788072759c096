"""Quantized linear modules: an ``nn.Linear`` replaced by the registry's kernel format (weight + scale).

The reference engine quantizes online by giving each linear layer a model-format ``weight`` and calling
its linear method's ``process_weights_after_loading`` once the weight has loaded; ``apply`` then runs the
matmul from the kernel-format tensors. :class:`QuantizedLinear` is that convention as a drop-in module
for models built from plain ``nn.Linear`` (diffusion transformers): constructing one from a loaded
linear runs the same processor, so its ``weight`` / ``weight_scale`` bytes are exactly those the engine's
online quantization produces for that weight, and ``forward`` is the method's ``apply`` (on CUDA fp8
tensor / channel scales with bf16 activations run ``torch._scaled_mm``; everything else dequantizes and
calls ``F.linear``).

Limitations: inference only (no gradients); hooks registered on the replaced ``nn.Linear`` are not
carried over; the full-precision weight is not kept (quantization cannot be undone).
"""

from __future__ import annotations

import torch
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.quant.base import LinearMethod
from weight_sync.quant.online import OnlineQuantLinearMethod
from weight_sync.quant.registry import make_linear_method

__all__ = ["QuantizedLinear", "quantize_linears"]


class QuantizedLinear(nn.Module):
    """A linear layer served from an online-quantized weight (``weight``, ``weight_scale``, ``bias``)."""

    def __init__(self, linear: nn.Linear, spec: object) -> None:
        super().__init__()
        method = make_linear_method(spec)
        if not isinstance(method, OnlineQuantLinearMethod):
            raise ConfigError(
                f"QuantizedLinear needs an online quantization (one of the registry's names or configs), "
                f"got {spec!r}, which resolves to the {method.name!r} method"
            )
        self.quant_method: LinearMethod = method
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The model-format weight, then the engine's own processing step turns it into kernel format
        # (replacing ``self.weight`` and adding ``self.weight_scale``). A new Parameter object: the
        # original linear is left untouched, so a caller can still put it back.
        self.weight = nn.Parameter(linear.weight.detach(), requires_grad=False)
        # The bias is not processed: the same object as the linear's (its storage is not copied).
        self.bias = linear.bias
        with torch.no_grad():
            method.process_weights_after_loading(self)

    @staticmethod
    def method_name(spec: object) -> str:
        """The linear method's name for ``spec`` (``"fp8"`` -> ``"fp8_tensor"``)."""
        return make_linear_method(spec).name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"method={self.quant_method.name}, weight={self.weight.dtype}")


def quantize_linears(
    module: nn.Module, spec: object
) -> list[tuple[nn.Module, str, nn.Linear, QuantizedLinear]]:
    """Replace every ``nn.Linear`` inside ``module`` by a :class:`QuantizedLinear` of ``spec``.

    Returns ``(parent, attribute, original, replacement)`` for each replacement, in module order, so a
    caller can undo it (``setattr(parent, attribute, original)``). A linear reachable under two names is
    quantized once and both names get the same replacement.
    """
    done: dict[int, QuantizedLinear] = {}
    swaps: list[tuple[nn.Module, str, nn.Linear, QuantizedLinear]] = []
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:  # subclasses may carry semantics a swap would drop
                continue
            q = done.get(id(child))
            if q is None:
                q = done[id(child)] = QuantizedLinear(child, spec)
            setattr(parent, name, q)
            swaps.append((parent, name, child, q))
    return swaps
