"""LoRA adapters merged into base weights on the fly (peft's layout, no peft import needed).

A peft LoRA layer wraps the original module as ``base_layer`` and holds per-adapter ``lora_A`` /
``lora_B`` (``ModuleDict`` of linears) or ``lora_embedding_A`` / ``lora_embedding_B`` (``ParameterDict``)
plus ``scaling[adapter]``. The engine wants plain weights, so the source sends
``W + sum over active adapters of scaling * (B @ A)`` (transposed for ``fan_in_fan_out`` and for
embeddings) under the base weight's name without ``.base_layer``, and never sends the adapter tensors.
Adapters peft already merged into the base weight (``merged_adapters``) are not added twice.
The delta is computed in float32 and added once, then cast to the base weight's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LoraFactor", "LoraLayerSpec", "find_lora_layers", "merge_lora"]


@dataclass(frozen=True, slots=True)
class LoraFactor:
    """One active adapter of one layer: B @ A scaled (A: (r, in), B: (out, r) for linears)."""

    adapter: str
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    embedding: bool
    fan_in_fan_out: bool


@dataclass(frozen=True, slots=True)
class LoraLayerSpec:
    """A LoRA-wrapped layer: the module path, its base weight and the adapters to merge."""

    path: str
    base_weight: torch.Tensor
    factors: tuple[LoraFactor, ...]
    adapter_param_names: tuple[str, ...]


def _is_lora_layer(m: nn.Module) -> bool:
    return hasattr(m, "base_layer") and hasattr(m, "scaling") and (
        hasattr(m, "lora_A") or hasattr(m, "lora_embedding_A")
    )


def _active(m: nn.Module) -> list[str]:
    if getattr(m, "disable_adapters", False):
        return []
    active = getattr(m, "active_adapters", None)
    if active is None:
        active = getattr(m, "active_adapter", None)
    if isinstance(active, str):
        active = [active]
    if active is None:
        active = list(getattr(m, "lora_A", {}).keys()) + list(getattr(m, "lora_embedding_A", {}).keys())
    merged = set(getattr(m, "merged_adapters", []) or [])
    return [a for a in active if a not in merged]


def find_lora_layers(model: nn.Module) -> dict[str, LoraLayerSpec]:
    """Every peft-style LoRA layer of ``model`` by module path (adapter tensors not materialized)."""
    specs: dict[str, LoraLayerSpec] = {}
    for path, m in model.named_modules():
        if not _is_lora_layer(m):
            continue
        base = m.base_layer
        factors = []
        for adapter in _active(m):
            scale = float(m.scaling[adapter])
            if hasattr(m, "lora_A") and adapter in m.lora_A:
                a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight
                factors.append(LoraFactor(adapter, a, b, scale, False, bool(getattr(m, "fan_in_fan_out", False))))
            elif hasattr(m, "lora_embedding_A") and adapter in m.lora_embedding_A:
                a, b = m.lora_embedding_A[adapter], m.lora_embedding_B[adapter]
                factors.append(LoraFactor(adapter, a, b, scale, True, False))
        adapter_names = tuple(
            f"{path}.{n}" if path else n
            for n, _ in m.named_parameters()
            if not n.startswith("base_layer.")
        )
        specs[path] = LoraLayerSpec(path, base.weight, tuple(factors), adapter_names)
    return specs


def merge_lora(
    base: torch.Tensor, factors: tuple[LoraFactor, ...], materialize: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``base`` plus every factor's scaled delta (``materialize`` gathers sharded tensors first)."""
    if not factors:
        return base
    delta = torch.zeros(base.shape, dtype=torch.float32, device=base.device)
    for f in factors:
        a = materialize(f.a).to(device=base.device, dtype=torch.float32)
        b = materialize(f.b).to(device=base.device, dtype=torch.float32)
        d = b @ a
        if f.embedding or f.fan_in_fan_out:
            d = d.T
        delta += d * f.scaling
    return (base.to(torch.float32) + delta).to(base.dtype)
