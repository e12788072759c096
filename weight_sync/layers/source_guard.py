"""Checks of thousands of source tensors against a recorded layout, each in one C++ pass.

A replayed bucket list (``reload/replay.py``) checks every source tensor of every update: its Python type,
dtype, device, shape and contiguity, then reads its pointer for the launch table. As one ``map`` per
property that is 7-8 C calls a tensor, ~0.5-0.9 us on the H200 host for a 6k-name MoE list: as much
host time as the device needs to copy the 3 MB expert slices, so a slower host turn made the update
host-bound. Two checks torch already runs in C++ for its own hot paths do the same in one pass each:

- :class:`SourceGuard`: Dynamo's ``TensorGuards`` (the check guarding every compiled graph's tensor
  inputs): per tensor the exact Python type, dispatch keys (device type, autograd, inference mode), dtype,
  device index, ``requires_grad``, sizes and strides, against those recorded.
- :func:`same_pointers`: CUDA graph trees' ``_tensors_data_ptrs_at_indices_equal``: every tensor's data
  pointer against a list (CUDA builds; a ``data_ptr`` pass elsewhere).

Both are private torch APIs, so neither is trusted blindly: :func:`source_guard` builds a guard only
after a self-test on this torch (it must accept the recorded tensors and refuse another dtype, shape,
stride and type) and returns None otherwise (callers then run their per-property passes, which give the
same verdicts: tests compare them), and :func:`same_pointers` reads every pointer where the function is
missing.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LaunchTables", "SourceGuard", "guards_available", "same_pointers", "source_guard"]

log = logging.getLogger(__name__)


def _tensor_guards(tensors: Sequence[torch.Tensor]) -> Any:
    guards: Any = torch._C._dynamo.guards  # (its stubs type the per-tensor size lists as flat)
    return guards.TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                               dynamic_dims_strides=[list(t.stride()) for t in tensors])


@functools.cache
def guards_available() -> bool:
    """Whether this torch's ``TensorGuards`` checks what :class:`SourceGuard` promises (tested once)."""
    try:
        base = [torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(3), torch.zeros((), dtype=torch.int64)]
        guard = _tensor_guards(base)
        same = [t.clone() for t in base]
        refused = (
            [torch.zeros(4, 8, dtype=torch.float16), same[1], same[2]],  # dtype
            [torch.zeros(4, 9, dtype=torch.bfloat16), same[1], same[2]],  # shape
            [torch.zeros(8, 4, dtype=torch.bfloat16).t(), same[1], same[2]],  # strides (not contiguous)
            [same[0], torch.nn.Parameter(torch.zeros(3), requires_grad=False), same[2]],  # type
            [same[0], same[1], torch.zeros(1, dtype=torch.int64)],  # dim
            [same[0], same[1], 3],  # not a tensor
        )
        ok = bool(guard.check(*same)) and not any(guard.check(*r) for r in refused)
    except Exception as e:  # a torch without it, or with another signature
        log.debug("TensorGuards unavailable (%s: %s): replayed lists check sources per property",
                  type(e).__name__, e)
        return False
    if not ok:
        log.debug("TensorGuards failed its self-test: replayed lists check sources per property")
    return ok


class SourceGuard:
    """The recorded type, dtype, device, shape and strides of a list of tensors, checked in one C++ pass."""

    __slots__ = ("_guard", "n")

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.n = len(tensors)
        self._guard = _tensor_guards(tensors)

    def check(self, tensors: Sequence[Any]) -> bool:
        """Whether ``tensors`` (as many as recorded) match the recorded ones element by element: the same
        Python type, dispatch keys, dtype, device, ``requires_grad``, sizes and strides."""
        if len(tensors) != self.n:
            return False
        return bool(self._guard.check(*tensors))


def source_guard(tensors: Sequence[torch.Tensor]) -> SourceGuard | None:
    """A guard recording ``tensors`` (all contiguous: a passing check then proves the checked ones are), or
    None where this torch offers none or a tensor is not contiguous (the caller checks per property)."""
    if not tensors or not guards_available() or not all(t.is_contiguous() for t in tensors):
        return None
    try:
        return SourceGuard(tensors)
    except Exception as e:  # e.g. a tensor subclass the guard cannot record
        log.debug("no source guard (%s: %s)", type(e).__name__, e)
        return None


_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


@functools.lru_cache(maxsize=64)
def _every_index(n: int) -> list[int]:
    return list(range(n))  # (shared and never mutated: the C++ check only reads it)


def same_pointers(tensors: list[Any], ptrs: list[int]) -> bool:
    """Whether ``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` (as many tensors as pointers, all
    tensors): one C++ pass where torch has it (CUDA builds), else one ``data_ptr`` pass."""
    if len(tensors) != len(ptrs):
        return False
    if _PTRS_EQUAL is None:
        return list(map(torch.Tensor.data_ptr, tensors)) == ptrs
    return bool(_PTRS_EQUAL(tensors, ptrs, _every_index(len(ptrs))))


class LaunchTables:
    """The device tables of a grouped launch that repeats over sources at the same addresses.

    A replayed list's launches (grouped copies, grouped fp8 quantizations) write fixed destinations from
    sources that, in most loops, are the same memory at every update: a trainer's own parameters, a
    receiver's imported regions, a bucket buffer. Their launch tables (source pointer, destination,
    sizes per tensor) are then the same bytes as last time: instead of reading every pointer to the host,
    filling a pinned table and copying it to the device, :meth:`reusable` checks the pointers in one C++
    pass and the kept device tables are launched again. Only where that pass is torch's C++ one (CUDA),
    and only on the stream the tables were copied on: stream order then puts that copy before any reuse.
    """

    __slots__ = ("_device", "_ptrs", "_stream", "tables")

    def __init__(self) -> None:
        self._ptrs: list[int] = []
        self._device: torch.device | None = None
        self._stream = 0
        self.tables: Any = None  # what the launch needs besides the sources (device tables, flags)

    def reusable(self, srcs: list[Any]) -> bool:
        """Whether the kept tables were made for sources at exactly these addresses, on the current stream."""
        return (self.tables is not None and len(srcs) == len(self._ptrs)
                and torch.cuda.current_stream(self._device).cuda_stream == self._stream
                and same_pointers(srcs, self._ptrs))

    def keep(self, ptrs: list[int], tables: Any, device: torch.device) -> None:
        """Keep ``tables``, copied to ``device`` on its current stream for sources at ``ptrs``, for the next
        launch (where pointers can be checked)."""
        if _PTRS_EQUAL is None or device.type != "cuda":
            return  # reading every pointer again would cost what building the tables does
        self._ptrs, self.tables, self._device = ptrs, tables, device
        self._stream = torch.cuda.current_stream(device).cuda_stream
