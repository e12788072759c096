"""Graph-visible tensors: everything a layer owns that a captured graph or compiled kernel may point at.

That is a layer's parameters, its buffers, and any plain tensor attribute in its ``__dict__`` (weight
scales, workspaces, repacked copies registered by a processor). Reload must keep every one of them at
the same address; :class:`TensorSignature` records what "the same" means and :func:`verify_signatures`
checks it after an update.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

from weight_sync.errors import PointerChangedError

__all__ = [
    "TensorSignature",
    "graph_visible_tensors",
    "iter_graph_visible_tensors",
    "layers_with_tensors",
    "signatures",
    "verify_signatures",
]


_ATTR_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[int, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def graph_visible_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``layer`` itself owns (not its children): parameters, buffers, tensor attributes."""
    # This runs for every module twice per update, so the scan of a module's (often large) __dict__
    # for tensor attributes is cached: while the dict keeps its size and the remembered names still
    # hold tensors, only those names are read. Adding or removing an attribute triggers a rescan.
    out: dict[str, torch.Tensor] = {k: v for k, v in layer._parameters.items() if v is not None}
    if layer._buffers:
        out.update({k: v for k, v in layer._buffers.items() if v is not None})
    d = layer.__dict__
    cached = _ATTR_CACHE.get(layer)
    attrs: dict[str, torch.Tensor] | None = None
    if cached is not None and cached[0] == len(d):
        attrs = {k: d[k] for k in cached[1] if isinstance(d.get(k), torch.Tensor)}
        if len(attrs) != len(cached[1]):
            attrs = None
    if attrs is None:
        attrs = {k: v for k, v in d.items() if isinstance(v, torch.Tensor)}
        _ATTR_CACHE[layer] = (len(d), tuple(attrs))
    if attrs:
        out.update({k: v for k, v in attrs.items() if not k.startswith("_ws_") and k not in out})
    return out


def _named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``list(model.named_modules())`` (same names, order and de-duplication) without generator recursion."""
    out: list[tuple[str, nn.Module]] = []
    memo: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", model)]
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in memo:
            continue
        memo.add(id(mod))
        out.append((prefix, mod))
        children = mod._modules
        if children:
            # Pushed in reverse so they pop in registration order: a pre-order walk like named_modules.
            stack.extend(reversed([
                (f"{prefix}.{name}" if prefix else name, child)
                for name, child in children.items() if child is not None
            ]))
    return out


def iter_graph_visible_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """All graph-visible tensors of ``model`` as (qualified name, tensor); shared tensors appear once."""
    seen: set[int] = set()
    for mod_name, mod in _named_modules(model):
        prefix = f"{mod_name}." if mod_name else ""
        for t_name, t in graph_visible_tensors(mod).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            yield prefix + t_name, t


def layers_with_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules that own at least one graph-visible tensor directly, in module order."""
    for name, mod in model.named_modules():
        if graph_visible_tensors(mod):
            yield name, mod


class TensorSignature(NamedTuple):
    """What a graph captured of a tensor: address, shape, dtype, stride, device."""

    data_ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSignature:
        return cls(t.data_ptr(), t.shape, t.dtype, t.stride(), t.device)

    def describe(self) -> str:
        return f"{self.shape} {str(self.dtype).removeprefix('torch.')} stride {self.stride} at {self.data_ptr:#x}"


_new_signature = tuple.__new__


def signatures(model: nn.Module) -> dict[str, TensorSignature]:
    """Signatures of every graph-visible tensor of ``model`` (meta tensors are skipped)."""
    # Taken twice per update over every tensor of the model: the tuples are built inline (what
    # TensorSignature.of does, minus its per-item call overhead).
    return {
        name: _new_signature(TensorSignature, (t.data_ptr(), t.shape, t.dtype, t.stride(), t.device))
        for name, t in iter_graph_visible_tensors(model)
        if not t.is_meta
    }


def verify_signatures(model: nn.Module, before: Mapping[str, TensorSignature]) -> None:
    """Raise :class:`PointerChangedError` if any tensor recorded in ``before`` moved or changed layout."""
    after = signatures(model)
    problems: list[str] = []
    for name, sig in before.items():
        now = after.get(name)
        if now is None:
            problems.append(f"{name}: was {sig.describe()}, now missing")
        elif now != sig:
            problems.append(f"{name}: was {sig.describe()}, now {now.describe()}")
    if problems:
        shown = "; ".join(problems[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PointerChangedError(
            f"{len(problems)} graph-visible tensor(s) changed during the update: {shown}{more}"
        )
