"""Capture a layer's tensors to meta records and rematerialize them, zero-filled, in model format.

A record keeps everything needed to rebuild the tensor a loader expects: its class (``nn.Parameter`` or a
subclass), shape, dtype, stride, ``requires_grad`` and the Python attributes hung on it (``weight_loader``,
``output_dim``, ...). Rematerialized tensors are zero-filled, never uninitialized: padding regions that no
loader writes must come out identical on every reload (uninitialized memory made a reload of the *same*
checkpoint change every logit in a reference system).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "TensorRecord",
    "capture_layer",
    "install_tensor",
    "records_nbytes",
    "rematerialize",
]

TensorKind = Literal["parameter", "buffer", "attribute"]


@dataclass(slots=True)
class TensorRecord:
    """Metadata of one tensor a layer owned at capture time (no data)."""

    name: str
    kind: TensorKind
    cls: type
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    requires_grad: bool
    attrs: dict[str, Any] = field(default_factory=dict)
    persistent: bool = True

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _tensor_attrs(t: torch.Tensor) -> dict[str, Any]:
    # Parameters carry loader metadata as instance attributes (weight_loader, output_dim, packed_dim...).
    return dict(getattr(t, "__dict__", {}))


def capture_layer(layer: nn.Module) -> dict[str, TensorRecord]:
    """Record the model-format metadata of every tensor ``layer`` owns directly."""
    records: dict[str, TensorRecord] = {}
    non_persistent: set[str] = getattr(layer, "_non_persistent_buffers_set", set())
    for name, p in layer._parameters.items():
        if p is None:
            continue
        records[name] = TensorRecord(
            name, "parameter", type(p), tuple(p.shape), p.dtype, tuple(p.stride()),
            p.requires_grad, _tensor_attrs(p),
        )
    for name, b in layer._buffers.items():
        if b is None:
            continue
        records[name] = TensorRecord(
            name, "buffer", type(b), tuple(b.shape), b.dtype, tuple(b.stride()), False,
            _tensor_attrs(b), persistent=name not in non_persistent,
        )
    return records


# Parameter classes whose constructor refused ``cls(data, requires_grad=...)`` (more arguments needed).
_NEEDS_MORE_ARGS: set[type] = set()


def rematerialize(
    record: TensorRecord, device: torch.device | str, *, data: torch.Tensor | None = None,
    pin: bool = False,
) -> torch.Tensor:
    """Build a tensor matching ``record`` (class, layout and attributes restored).

    Its contents are zeros, or ``data`` (which must already have the record's shape and dtype). ``pin``
    puts zero-filled host staging in page-locked memory.
    """
    if data is None:
        data = torch.empty_strided(
            record.shape, record.stride, dtype=record.dtype, device=device, pin_memory=pin
        ).zero_()
    if record.kind == "parameter":
        cls = record.cls if issubclass(record.cls, nn.Parameter) else nn.Parameter
        t: torch.Tensor
        if cls not in _NEEDS_MORE_ARGS:
            try:
                t = cls(data, requires_grad=record.requires_grad)
            except TypeError:
                # Remembered per class: a failed constructor call (and its exception) costs more than
                # the rebuild, and reload rematerializes the same classes on every update.
                _NEEDS_MORE_ARGS.add(cls)
                t = torch.Tensor._make_subclass(cls, data, record.requires_grad)
        else:
            # Subclasses whose constructor takes other arguments (vLLM's ModelWeightParameter needs a
            # weight_loader) are rebuilt the way nn.Parameter.__new__ builds them, skipping __init__;
            # the record's attributes below restore what __init__ had set. Falling back to a plain
            # Parameter would lose class-level behaviour (vLLM's weight_loader is a property).
            t = torch.Tensor._make_subclass(cls, data, record.requires_grad)
    else:
        t = data
    for k, v in record.attrs.items():
        setattr(t, k, v)
    return t


def install_tensor(layer: nn.Module, record: TensorRecord, tensor: torch.Tensor) -> None:
    """Register ``tensor`` on ``layer`` under the record's name and kind (replacing what is there)."""
    if record.name in vars(layer) and record.kind != "attribute":
        del layer.__dict__[record.name]
    if record.kind == "parameter":
        layer._buffers.pop(record.name, None)
        layer._parameters[record.name] = tensor  # type: ignore[assignment]
    elif record.kind == "buffer":
        layer._parameters.pop(record.name, None)
        layer.register_buffer(record.name, tensor, persistent=record.persistent)
    else:
        layer._parameters.pop(record.name, None)
        layer._buffers.pop(record.name, None)
        object.__setattr__(layer, record.name, tensor)


def records_nbytes(records: Mapping[str, TensorRecord]) -> int:
    """Bytes a set of records occupies when rematerialized."""
    return sum(r.nbytes for r in records.values())
