"""The checks every loader shares: can this checkpoint tensor be copied into that destination?"""

from __future__ import annotations

import torch

from weight_sync.errors import LayoutMismatchError

__all__ = ["check_loadable", "default_weight_loader", "describe"]


def describe(t: torch.Tensor) -> str:
    """'(rows, cols) dtype' for error messages."""
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


def check_loadable(dest: torch.Tensor, loaded: torch.Tensor, what: str = "") -> None:
    """Raise LayoutMismatchError unless ``loaded`` can be copied into ``dest`` (same shape, castable dtype).

    Float -> float casts are allowed (a bf16 checkpoint into an fp32 engine and back); an integer or bool
    tensor for a floating-point weight is refused, as it cannot stand for the weight.
    """
    if tuple(dest.shape) != tuple(loaded.shape):
        raise LayoutMismatchError(f"{what}expects {describe(dest)}, got {describe(loaded)}")
    if dest.dtype.is_floating_point and not loaded.dtype.is_floating_point:
        raise LayoutMismatchError(
            f"{what}expects a floating-point tensor ({describe(dest)}), got {describe(loaded)}"
        )


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copy a whole tensor into a parameter after checking shape and dtype."""
    check_loadable(param, loaded_weight)
    param.data.copy_(loaded_weight)
