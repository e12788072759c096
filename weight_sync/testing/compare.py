"""Bitwise comparison of models' kernel tensors (fp8 and int8 included)."""

from __future__ import annotations

import torch
from torch import nn

from weight_sync.checksum import raw_bytes
from weight_sync.layers.tensors import iter_graph_visible_tensors

__all__ = ["assert_bitwise_equal", "bitwise_equal", "kernel_tensors"]


def kernel_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every graph-visible tensor of ``model`` by qualified name (shared tensors once)."""
    return dict(iter_graph_visible_tensors(model))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaNs with equal bits compare equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(raw_bytes(a.detach().cpu()), raw_bytes(b.detach().cpu()))


def assert_bitwise_equal(actual: nn.Module, expected: nn.Module) -> None:
    """Raise AssertionError naming every kernel tensor that differs in name set, layout or bytes."""
    got, want = kernel_tensors(actual), kernel_tensors(expected)
    problems = []
    if set(got) != set(want):
        problems.append(f"names differ: only actual {sorted(set(got) - set(want))}, "
                        f"only expected {sorted(set(want) - set(got))}")
    for name in sorted(set(got) & set(want)):
        if not bitwise_equal(got[name], want[name]):
            problems.append(f"{name}: {tuple(got[name].shape)} {got[name].dtype} differs from "
                            f"{tuple(want[name].shape)} {want[name].dtype}")
    if problems:
        raise AssertionError(f"{len(problems)} kernel tensor(s) differ: " + "; ".join(problems[:8]))
