"""Which tensors of a module the cache stores, and whether their layout is one the cache supports.

The cache stores parameters and *persistent* buffers by qualified name. Non-persistent buffers (RoPE
frequencies and the like) are recomputed at construction and never cached. Supported means: a plain
dense CPU tensor, contiguous, of a dtype in :data:`SUPPORTED_DTYPES`, sharing storage with no other
selected tensor. Anything else (quantized dtypes or tensor subclasses, non-contiguous strides, tied or
aliased tensors, meta or device tensors) keeps the ordinary tensors.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.offload.cache.entry_manifest import SUPPORTED_DTYPES
from weight_sync.offload.cache.identity import TensorSpec

__all__ = [
    "cacheable_tensors",
    "final_layout_problem",
    "select_tensors",
    "static_layout_problem",
]

_SUPPORTED = frozenset(SUPPORTED_DTYPES.values())


def cacheable_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers of ``module`` by qualified name, tied names included."""
    out: dict[str, torch.Tensor] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in mod._parameters.items():
            if p is not None:
                out[prefix + name] = p
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                out[prefix + name] = b
    return out


def select_tensors(
    module: nn.Module, tensor_names: Sequence[str] | None
) -> dict[str, torch.Tensor]:
    """The tensors to cache: all cacheable ones, or exactly ``tensor_names`` (each must exist)."""
    available = cacheable_tensors(module)
    if tensor_names is None:
        selected = available
    else:
        if isinstance(tensor_names, str):
            raise ConfigError(
                f"tensor_names must be a sequence of names, got the str {tensor_names!r}"
            )
        missing = [n for n in tensor_names if n not in available]
        if missing:
            raise ConfigError(
                f"tensor_names: {missing[:5]} are not parameters or persistent buffers of "
                f"{type(module).__name__} ({len(available)} available, e.g. {sorted(available)[:3]})"
            )
        if len(set(tensor_names)) != len(tensor_names):
            raise ConfigError(f"tensor_names lists a name twice: {sorted(tensor_names)[:5]}")
        selected = {n: available[n] for n in tensor_names}
    if not selected:
        raise ConfigError(
            f"{type(module).__name__} has no parameters or persistent buffers to cache"
        )
    return selected


def static_layout_problem(selected: Mapping[str, torch.Tensor]) -> str | None:
    """Why the selection can never be cached (known before loading), or None.

    Meta tensors pass here: their shape and dtype are known, and the ordinary load may materialize them.
    """
    first_name_of: dict[int, str] = {}
    for name, t in selected.items():
        other = first_name_of.setdefault(id(t), name)
        if other != name:
            return f"tied tensors: {other!r} and {name!r} are the same tensor"
        if type(t) not in (torch.Tensor, nn.Parameter) or t.is_quantized:
            return f"{name!r} is a {type(t).__name__} (quantized or a tensor subclass)"
        if t.dtype not in _SUPPORTED:
            return (
                f"{name!r} has dtype {t.dtype}; the cache stores only "
                f"{sorted(str(d).removeprefix('torch.') for d in _SUPPORTED)} (quantized layouts are not supported)"
            )
        if t.device.type not in ("cpu", "meta"):
            return f"{name!r} lives on {t.device} (device-only tensors are not cached)"
        if t.layout != torch.strided:
            return f"{name!r} has layout {t.layout}"
        if not t.is_contiguous():
            return f"{name!r} is non-contiguous (stride {tuple(t.stride())})"
    return None


def final_layout_problem(
    selected: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]
) -> str | None:
    """Why the loaded tensors cannot be published or replaced by an entry, or None.

    Beyond :func:`static_layout_problem`: every tensor must now be on the CPU, keep the shape and dtype it
    had before loading (the key was computed from those), and share storage with no other selected
    tensor (a write through one alias must keep reaching the other, which separate mmap views break).
    """
    problem = static_layout_problem(selected)
    if problem:
        return problem
    for spec in specs:
        t = selected[spec.name]
        if t.device.type != "cpu":
            return f"{spec.name!r} is on {t.device} after loading (meta/device-only tensors are not cached)"
        if (tuple(t.shape), t.dtype) != (spec.shape, spec.dtype):
            return (
                f"{spec.name!r} changed from {spec.shape} {spec.dtype} to {tuple(t.shape)} {t.dtype} "
                f"during loading; the cache key was computed from the former"
            )
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
        for name, t in selected.items()
        if t.numel()
    )
    for (_, end_a, name_a), (start_b, _, name_b) in itertools.pairwise(spans):
        if start_b < end_a:
            return f"aliased tensors: {name_a!r} and {name_b!r} share storage"
    return None
