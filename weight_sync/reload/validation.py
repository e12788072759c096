"""Manifest validation: every announced tensor checked against the engine's plan before any write."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from weight_sync.errors import ManifestError, WeightSyncError
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.reload.plan import KeyPlan, Plan
from weight_sync.reload.recorder import plan_keys
from weight_sync.reload.state import AcceptedManifest, ModelState, name_list

__all__ = [
    "accept_manifest",
    "check_against_plan",
    "fmt_layout",
    "lacking_from_reference",
    "name_list",
    "plan_missing",
    "rewritten_layers",
    "validate_manifest",
]


def fmt_layout(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """``(4, 8) bfloat16``: how errors name a layout."""
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def plan_missing(model: nn.Module, state: ModelState, plan: Plan, metas: list[TensorMeta]) -> dict[str, WeightSyncError]:
    """Plan the keys of ``metas`` the plan does not know yet; returns the problems found, by name."""
    todo = [m for m in metas if m.name not in plan.keys]
    plans, problems = plan_keys(model, state, todo)
    for kp in plans:
        plan.add(kp)
    return problems


def check_against_plan(kp: KeyPlan, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    """Why a tensor of ``shape`` / ``dtype`` cannot fill key ``kp`` (None when it can)."""
    if tuple(shape) != kp.shape:
        return f"{kp.name}: engine expects {fmt_layout(kp.shape, kp.dtype)}, got {fmt_layout(shape, dtype)}"
    if kp.mode != "ignored" and not dtype.is_floating_point and kp.dtype.is_floating_point:
        return (
            f"{kp.name}: engine expects a floating-point tensor {fmt_layout(kp.shape, kp.dtype)}, "
            f"got {fmt_layout(shape, dtype)}"
        )
    return None


def accept_manifest(
    model: nn.Module, state: ModelState, plan: Plan, manifest: Manifest, allow_partial: bool
) -> tuple[frozenset[str], dict[str, tuple[torch.Size, torch.dtype]]]:
    """Validate ``manifest`` (or reuse the verdict on an equal one); its expected names and layouts.

    Validation depends only on the announced entries, ``allow_partial``, the reference manifest and
    the plan, whose key plans never change once made (it only grows). An update announcing what the
    previous one did, against the same reference and plan, passed the same checks then.
    """
    cached = state.accepted
    if (
        cached is not None
        and cached.allow_partial == allow_partial
        and cached.reference is state.reference
        and cached.plan_size == len(plan.keys)
        and cached.tensors == manifest.tensors
    ):
        return cached.expected, cached.announced
    validate_manifest(model, state, plan, manifest, allow_partial)
    expected = frozenset(manifest.names)
    announced = {m.name: (torch.Size(m.shape), m.dtype) for m in manifest}
    state.accepted = AcceptedManifest(
        manifest.tensors, allow_partial, state.reference, len(plan.keys), expected, announced,
    )
    return expected, announced


def validate_manifest(model: nn.Module, state: ModelState, plan: Plan, manifest: Manifest, allow_partial: bool) -> None:
    """Raise :class:`ManifestError` listing every problem of ``manifest`` against the model (no writes)."""
    problems = {k: str(e) for k, e in plan_missing(model, state, plan, list(manifest)).items()}
    for m in manifest:
        kp = plan.keys.get(m.name)
        if kp is not None and m.name not in problems:
            msg = check_against_plan(kp, m.shape, m.dtype)
            if msg:
                problems[m.name] = msg
    if not allow_partial and state.reference is not None:
        lacking = [n for n in state.reference.names if n not in manifest]
        lacking = [n for n in lacking if plan.keys.get(n) is None or plan.keys[n].mode != "ignored"]
        if lacking:
            problems["<coverage>"] = (
                f"the manifest lacks {len(lacking)} tensor(s) the model expects: {name_list(lacking)} "
                "(pass allow_partial=True to update a subset)"
            )
    # A processed layer can only be processed from all of its keys.
    announced = set(manifest.names)
    for m in manifest:
        kp = plan.keys.get(m.name)
        if kp is None:
            continue
        for layer in kp.layers:
            info = state.layers[layer]
            if not info.direct:
                layer_lacking = plan.layer_keys.get(layer, set()) - announced
                if layer_lacking:
                    problems.setdefault(
                        f"<layer {layer}>",
                        f"layer {layer} needs processing and so needs all of its tensors; "
                        f"the manifest lacks {name_list(layer_lacking)}",
                    )
    if problems:
        first = list(problems.values())
        raise ManifestError(
            f"manifest rejected before any write ({len(first)} problem(s)): " + "; ".join(first[:5])
            + (f"; ... ({len(first) - 5} more)" if len(first) > 5 else "")
        )


def lacking_from_reference(state: ModelState, plan: Plan, arrived: set[str]) -> list[str]:
    """Tensors of the reference layout that did not arrive (ignored keys excluded)."""
    ref = state.reference
    if ref is None:
        return []
    names = ref.names
    if arrived.issuperset(names):  # the common case, one pass in C
        return []
    lacking = []
    for n in names:
        if n not in arrived:
            kp = plan.keys.get(n)
            if kp is None or kp.mode != "ignored":
                lacking.append(n)
    return lacking


def rewritten_layers(state: ModelState, plan: Plan, arrived: set[str], layers: Iterable[str]) -> set[str]:
    """Of ``layers``, those an update wrote whole: every key of the layer (of the reference layout, where
    the reference names any) arrived."""
    ref = state.reference
    ref_names = set(ref.names) if ref is not None and state.torn_layers else set()
    out = set()
    for layer in layers:
        need = plan.layer_keys.get(layer, set())
        if need & ref_names:
            need = need & ref_names
        if need and need <= arrived:
            out.add(layer)
    return out
