"""Pointer audit of an update: one walk of the model at begin, an indexed re-check at finish.

The audit's promise (DESIGN decision 7): after an update every graph-visible tensor that existed before it
keeps its data_ptr, shape, dtype, stride and device. ``signatures`` / ``verify_signatures`` prove it by
walking the module tree twice (every module's parameters, buffers and tensor attributes), which is most of
the host cost of a small update. The walk at begin stays: it is the baseline, and it is what notices that
something moved *between* updates (which invalidates cached destination views). The one at finish is
replaced by a re-check of what the first walk found, indexed by where it was found:

- every module reached by the walk is still its parent's child under the same name (the tree that gave
  each tensor its qualified name is unchanged, so no tensor was hidden or renamed by a module swap);
- every tensor object is still bound at its (module, attribute) place - the same Python object, not a
  replacement (``module.weight = new``, a reinstall that forgot one);
- and that object keeps its signature (``param.data = x``, ``set_``, ``resize_`` change it in place).

A tensor's signature can change only by rebinding the place that holds it or by changing the object in
place, so these checks see every change the second walk would see, for every tensor of the baseline,
whoever made it (processors, model loaders, hooks, the caller's own code between loads). They cost one
dict lookup per module and per tensor plus one signature per tensor, instead of re-scanning every
module's attributes. When a check fails, the full walk runs and its verdict (and message) is the one
raised, so a failure reads exactly as before.

The next update's begin reuses the last committed update's baseline the same way (:func:`still_holds`):
the indexed re-check plus, for every module, the sizes of its parameter, buffer, child and attribute
dicts, so a tensor or module *added* since (which the baseline would not cover) makes it walk again. A
walk and a re-check therefore agree on everything the attribute cache of ``graph_visible_tensors``
itself relies on (an attribute replaced by a tensor under a dict of unchanged size is outside both).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from weight_sync.errors import UpdateStateError
from weight_sync.layers.source_guard import SourceGuard, guards_available, same_pointers
from weight_sync.layers.tensors import TensorSignature, graph_visible_tensors, verify_signatures

__all__ = ["Baseline", "check_layers_recorded", "still_holds", "take_baseline", "verify_baseline"]

_new_signature = tuple.__new__


@dataclass(slots=True)
class Baseline:
    """The graph-visible tensors of a model at one point, with where each was found."""

    signatures: dict[str, TensorSignature]
    # The root model appears as None in these: a baseline kept in the model's reload state between
    # updates must not reference the model itself (the state is a weak-keyed entry of it, and a value
    # referencing its key keeps it alive forever); the re-checks are given the model.
    # (qualified child name, parent, attribute name, child) for every module the walk entered.
    edges: list[tuple[str, nn.Module | None, str, nn.Module]] = field(default_factory=list)
    # (qualified tensor name, module, attribute name, tensor) for every signature.
    places: list[tuple[str, nn.Module | None, str, torch.Tensor]] = field(default_factory=list)
    # (module, its dict sizes) for every module the walk entered: what an addition would change.
    sizes: list[tuple[nn.Module | None, tuple[int, int, int, int]]] = field(default_factory=list)
    # The places' tensors and, field by field, their signatures: the re-check compares each field of
    # every tensor as one pass in C (building a signature tuple per tensor costs about as much again).
    tensors: list[torch.Tensor] = field(default_factory=list)
    columns: tuple[tuple[Any, ...], ...] = ()
    # The tensors' type, dtype, device, shape and strides in one C++ check (layers/source_guard.py), with
    # the data pointers as a list for the one-pass pointer check; None: compared field by field. Stricter than a signature (it also compares requires_grad and dispatch keys): a
    # tensor it refuses is decided by the full walk, as any re-check failure is.
    guard: SourceGuard | None = None
    ptrs: list[int] = field(default_factory=list)

    def release(self) -> None:
        """Drop the references to modules and tensors (the signatures stay)."""
        self.edges.clear()
        self.places.clear()
        self.sizes.clear()
        self.tensors.clear()
        self.columns = ()
        self.guard = None


# A signature's fields, read the way TensorSignature's are (data_ptr, shape, dtype, stride, device).
_FIELDS: tuple[Callable[[torch.Tensor], Any], ...] = (
    torch.Tensor.data_ptr, attrgetter("shape"), attrgetter("dtype"), torch.Tensor.stride, attrgetter("device"),
)


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    """``t``'s signature fields through its own methods (what the full walk of verify_signatures reads)."""
    return (t.data_ptr(), t.shape, t.dtype, t.stride(), t.device)


def _sizes(mod: nn.Module) -> tuple[int, int, int, int]:
    return len(mod._parameters), len(mod._buffers), len(mod._modules), len(mod.__dict__)


def take_baseline(model: nn.Module) -> Baseline:
    """Walk ``model`` once: the same signatures as :func:`weight_sync.layers.tensors.signatures` (same
    names, same de-duplication of shared modules and tensors), plus the index the re-check needs."""
    sigs: dict[str, TensorSignature] = {}
    base = Baseline(sigs)
    edges, places, sizes = base.edges, base.places, base.sizes
    seen_modules: set[int] = set()
    seen_tensors: set[int] = set()
    # Pre-order, children in registration order, each module once: the walk of ``_named_modules``.
    stack: list[tuple[str, nn.Module | None, str, nn.Module]] = [("", None, "", model)]
    while stack:
        path, parent, attr, mod = stack.pop()
        if id(mod) in seen_modules:
            continue
        seen_modules.add(id(mod))
        held = None if mod is model else mod
        sizes.append((held, _sizes(mod)))
        if parent is not None:
            edges.append((path, None if parent is model else parent, attr, mod))
        prefix = f"{path}." if path else ""
        for name, t in graph_visible_tensors(mod).items():
            if id(t) in seen_tensors:
                continue
            seen_tensors.add(id(t))
            if t.is_meta:
                continue
            qual = prefix + name
            sigs[qual] = _new_signature(TensorSignature, _signature(t))
            places.append((qual, held, name, t))
        children = mod._modules
        if children:
            stack.extend(reversed([
                (prefix + name, mod, name, child) for name, child in children.items() if child is not None
            ]))
    base.tensors = [t for _, _, _, t in places]
    base.columns = tuple(zip(*(sigs[qual] for qual, _, _, _ in places))) or ((),) * len(_FIELDS)
    if base.tensors and guards_available():
        try:
            base.guard = SourceGuard(base.tensors)
        except Exception:  # a tensor the guard cannot record (a wrapper subclass): field by field
            base.guard = None
        else:
            base.ptrs = list(base.columns[0])
    return base


def _unchanged(base: Baseline, skip: tuple[str, ...], model: nn.Module) -> bool:
    """Whether every module and tensor of ``base`` (outside the ``skip`` prefixes) is where it was."""
    for path, parent, attr, child in base.edges:
        if (model if parent is None else parent)._modules.get(attr) is not child and not (
                skip and (path + ".").startswith(skip)):
            return False
    sigs = base.signatures
    for qual, held, name, t in base.places:
        if skip and qual.startswith(skip):
            continue
        mod = model if held is None else held
        # Looked up in graph_visible_tensors' order: parameters, buffers, then plain attributes.
        bound: torch.Tensor | None = mod._parameters.get(name)
        if bound is None:
            bound = mod._buffers.get(name)
            if bound is None:
                bound = mod.__dict__.get(name)
        if bound is not t or (skip and _signature(t) != sigs[qual]):
            return False
    if skip:
        return True
    # Every tensor is still bound where it was: compare the signatures, in one C++ pass for the layouts
    # and one for the pointers where torch offers them, else field by field. The C methods are read
    # unbound (what a plain tensor's own would return); a subclass overriding one of them only ever
    # fails this, and the full walk of verify_baseline then decides with its own methods.
    tensors = base.tensors
    if base.guard is not None:
        if not base.guard.check(tensors):
            return False
        return same_pointers(tensors, base.ptrs)
    return all(tuple(map(read, tensors)) == column for read, column in zip(_FIELDS, base.columns, strict=True))


def still_holds(base: Baseline, model: nn.Module) -> bool:
    """Whether ``base`` (a baseline kept from an earlier update) still describes the model exactly:
    nothing moved, was rebound or changed layout, and no module gained or lost a parameter, buffer,
    child or attribute. If so it can serve as this update's baseline without a walk."""
    if not base.sizes:
        return False  # released
    for mod, n in base.sizes:
        if _sizes(model if mod is None else mod) != n:
            return False
    return _unchanged(base, (), model)


def verify_baseline(model: nn.Module, base: Baseline, skip: tuple[str, ...] = ()) -> None:
    """Raise :class:`PointerChangedError` if a tensor of ``base`` moved or changed layout; tensors whose
    name starts with one of ``skip`` (layers processed for the first time: new by design) are exempt."""
    if _unchanged(base, skip, model):
        return
    before = base.signatures
    if skip:
        before = {k: v for k, v in before.items() if not k.startswith(skip)}
    verify_signatures(model, before)  # the full walk decides, and names what moved


def check_layers_recorded(layers: Mapping[str, Any], base: Baseline) -> None:
    """Refuse an update of a model whose recorded layers were replaced since they were recorded: reload
    writes into the recorded modules, so the replacement would silently keep its own weights."""
    at = {path: child for path, _, _, child in base.edges}
    for name, info in layers.items():
        now = at.get(name) if name else info.module
        if now is not info.module:
            found = "nothing" if now is None else f"another {type(now).__name__}"
            raise UpdateStateError(
                f"layer {name!r}: expected the {type(info.module).__name__} recorded by "
                f"record_metadata_for_reloading, found {found} there; a replaced layer cannot be "
                "updated in place (record a newly built model instead)"
            )
