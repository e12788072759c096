"""The plan: where each checkpoint key lands in a model, as replayable copies (see :mod:`.recorder`).

A :class:`KeyPlan` says how one key is loaded: a few strided :class:`CopyOp` copies (which slice of which
layer tensor, from which slice of the incoming tensor), the model's real loader (for loaders that compute
on the incoming tensor), or nothing (a key the model ignores). :class:`Plan` holds them with, per layer,
the keys it expects before it is complete. Plans only grow: a key's plan never changes once made.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from weight_sync.layers.meta import TensorRecord

__all__ = ["CopyOp", "KeyMode", "KeyPlan", "LoaderCall", "Plan", "loader_call_args", "span"]

KeyMode = Literal["copy", "loader", "ignored"]

# A ``weight_loader`` call as the plan remembers it: (layer, tensor, the call's arguments after the
# parameter and the loaded tensor, bound to the loader's signature: ((name, value), ...)).
LoaderCall = tuple[str, str, tuple[tuple[str, Any], ...]]

_SIGNATURES: dict[Any, inspect.Signature | None] = {}


def loader_call_args(loader: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """The arguments of ``loader(param, loaded, *rest)`` after the first two, by name, defaults applied
    (so ``shard_id="q"`` and a positional ``"q"`` compare equal); None when they are not hashable."""
    fn = getattr(loader, "__func__", loader)
    if fn not in _SIGNATURES:
        try:
            _SIGNATURES[fn] = inspect.signature(loader)
        except (TypeError, ValueError):
            _SIGNATURES[fn] = None
    sig = _SIGNATURES[fn]
    if sig is None:
        bound = tuple(enumerate(args[2:])) + tuple(sorted(kwargs.items()))
    else:
        ba = sig.bind(*args, **kwargs)
        ba.apply_defaults()
        bound = tuple(ba.arguments.items())[2:]
    try:
        hash(bound)
    except TypeError:
        return None
    return bound


@dataclass(frozen=True, slots=True)
class CopyOp:
    """Copy ``src`` (a strided view of the incoming tensor) into a strided view of a layer tensor."""

    layer: str
    tensor: str
    dst_offset: int  # elements, relative to the tensor's own storage offset
    dst_size: tuple[int, ...]
    dst_stride: tuple[int, ...]
    src_offset: int  # elements, relative to the incoming (contiguous) tensor's storage offset
    src_size: tuple[int, ...]
    src_stride: tuple[int, ...]
    src_whole: bool  # src is the whole incoming tensor: replay passes it unchanged


def dst_view(base: torch.Tensor, op: CopyOp) -> torch.Tensor:
    """The region of layer tensor ``base`` that ``op`` writes (``base`` itself when it is all of it)."""
    if op.dst_offset == 0 and base.shape == op.dst_size and base.stride() == op.dst_stride:
        return base
    return base.as_strided(op.dst_size, op.dst_stride, base.storage_offset() + op.dst_offset)


@dataclass(slots=True)
class KeyPlan:
    """How one checkpoint key is loaded: replayed copies, the real loader, or ignored."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mode: KeyMode
    layers: tuple[str, ...]
    ops: tuple[CopyOp, ...] = ()
    # The weight_loader calls the model's load_weights made for this key (see LoaderCall).
    calls: tuple[LoaderCall, ...] = ()
    # True when the destination is a floating-point weight (integer data cannot stand for it).
    floating: bool = field(init=False)

    def __post_init__(self) -> None:
        self.floating = self.mode != "ignored" and self.dtype.is_floating_point


@dataclass(slots=True)
class Plan:
    """Key plans plus, per layer, the keys it expects before it is complete."""

    keys: dict[str, KeyPlan] = field(default_factory=dict)
    layer_keys: dict[str, set[str]] = field(default_factory=dict)
    # Per layer, the tensors its keys' recorded copies write entirely (computed on demand, cached).
    coverage: dict[str, frozenset[str]] = field(default_factory=dict)
    # Per layer, its units (see reload/units.py) or why it has none (computed on demand, cached).
    units: dict[str, Any] = field(default_factory=dict)
    # Per layer, whether its keys' copies are aligned row bands (see reload/bands.py; on demand, cached).
    bands: dict[str, bool] = field(default_factory=dict)
    # A key's single weight_loader call -> the key (None where two keys made the same call).
    loader_calls: dict[LoaderCall, str | None] = field(default_factory=dict)
    # Bumped by every add(): what is derived from the key plans elsewhere (delta routes) is made again.
    generation: int = 0

    def add(self, kp: KeyPlan) -> None:
        self.generation += 1
        old = self.keys.get(kp.name)
        if old is not None:
            for layer in old.layers:
                self.layer_keys.get(layer, set()).discard(kp.name)
                self.coverage.pop(layer, None)
                self.units.pop(layer, None)
                self.bands.pop(layer, None)
            for call in old.calls:
                if self.loader_calls.get(call) == kp.name:
                    del self.loader_calls[call]
        self.keys[kp.name] = kp
        for layer in kp.layers:
            self.layer_keys.setdefault(layer, set()).add(kp.name)
            self.coverage.pop(layer, None)
            self.units.pop(layer, None)
            self.bands.pop(layer, None)
        if len(kp.calls) == 1:
            call = kp.calls[0]
            self.loader_calls[call] = kp.name if self.loader_calls.get(call, kp.name) == kp.name else None

    def fully_written(self, layer: str, records: Mapping[str, TensorRecord]) -> frozenset[str]:
        """Names of ``layer``'s tensors that the recorded copies of its keys overwrite element by element.

        A tensor written only partly, or by a real loader call (whose writes are not recorded), is not
        in the set. Staging for the tensors in the set needs no zero fill: every byte is written before
        the layer is processed.
        """
        cached = self.coverage.get(layer)
        if cached is not None:
            return cached
        keys = [self.keys[k] for k in self.layer_keys.get(layer, ())]
        if any(kp.mode == "loader" for kp in keys):
            self.coverage[layer] = frozenset()
            return self.coverage[layer]
        masks: dict[str, torch.Tensor] = {}
        for kp in keys:
            for op in kp.ops:
                rec = records.get(op.tensor)
                if op.layer != layer or rec is None:
                    continue
                mask = masks.get(op.tensor)
                if mask is None:
                    mask = masks[op.tensor] = torch.zeros(
                        span(rec.shape, rec.stride), dtype=torch.bool
                    )
                mask.as_strided(op.dst_size, op.dst_stride, op.dst_offset).fill_(True)
        full = frozenset(
            name for name, mask in masks.items()
            if bool(mask.as_strided(records[name].shape, records[name].stride).all())
        )
        self.coverage[layer] = full
        return full


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a dimension of size 0 counts as 1)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of storage a (shape, stride) view spans from its first element."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride))
