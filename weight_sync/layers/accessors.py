"""Per-tensor reads for passes over thousands of tensors, at the cost of one C call each.

A replayed MoE bucket list checks ~6k source tensors per update (dtype, shape, device, contiguity,
pointer), one ``map`` per property. Through the instance (``t.data_ptr()``, ``methodcaller``) every call
first resolves the method on the instance's Python class and binds it: 300-360 ns a tensor on the CPU
host, where the C method itself takes 110-140 ns. These are the same C methods (``torch.Tensor``
inherits them from ``torch._C.TensorBase``), called unbound. For instances of :data:`PLAIN_TYPES`
(checked with :func:`all_plain`, one ``type`` call each) they are exactly what the instance would
resolve. They still honour ``__torch_function__`` (the C methods check for it themselves); only a
Python subclass overriding one of them would differ, and its tensors are not plain.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter

import torch
from torch import nn

__all__ = [
    "PLAIN_TYPES",
    "all_plain",
    "data_ptr",
    "dim",
    "dtype_of",
    "get_device",
    "is_contiguous",
    "numel",
    "rows",
    "shape_by_counts",
    "shape_of",
]

data_ptr = torch.Tensor.data_ptr
is_contiguous = torch.Tensor.is_contiguous
get_device = torch.Tensor.get_device
dim = torch.Tensor.dim
numel = torch.Tensor.numel
# The size of dimension 0 (0 for a 0-d tensor): TensorBase's C slot (Tensor.__len__ is Python, and raises
# on a 0-d tensor).
rows = torch._C.TensorBase.__len__  # type: ignore[attr-defined]  # (a C slot the stubs omit)
# Properties: attrgetter reads them as fast as the descriptor would be called unbound.
dtype_of = attrgetter("dtype")
shape_of = attrgetter("shape")

# The tensor types whose methods are TensorBase's own (a trainer's tensors and parameters).
PLAIN_TYPES = frozenset({torch.Tensor, nn.Parameter})


def shape_by_counts(shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` is the only one with its :func:`dim`, :func:`numel` and :func:`rows`: a 1-d or 2-d
    shape with no zero size. Checking those three counts (plain ints, 50-90 ns a tensor each on the GPU
    host) then checks the shape; reading ``.shape`` builds a ``torch.Size`` per tensor (~210 ns), a
    tracked object whose thousands per pass set off garbage collections."""
    return len(shape) in (1, 2) and all(shape)


def all_plain(tensors: Iterable[object]) -> bool:
    """Whether every one of ``tensors`` is a ``torch.Tensor`` or ``nn.Parameter`` exactly (no subclass)."""
    return set(map(type, tensors)) <= PLAIN_TYPES
