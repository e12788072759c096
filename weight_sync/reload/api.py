"""Entry points of the reload lifecycle, plus the seed's low-level names as thin aliases.

``begin_update`` / ``UpdateSession.load`` / ``finish`` is the transaction API; ``reload_weights`` wraps it
for a safetensors directory or an iterable. ``record_metadata_for_reloading``,
``initialize_layerwise_reload`` and ``finalize_layerwise_processing`` exist so vLLM users find the names
they know: after ``initialize_layerwise_reload(model)``, a plain ``model.load_weights(...)`` feeds the
session until ``finalize_layerwise_processing(model)`` commits it.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from weight_sync.checkpoints import checkpoint_metas, map_checkpoint
from weight_sync.errors import SourceError, UpdateStateError, WeightSyncError
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.reload.audit import still_holds
from weight_sync.reload.loaders import route_weight_loaders
from weight_sync.reload.plan import Plan
from weight_sync.reload.report import UpdateReport
from weight_sync.reload.session import UpdateSession
from weight_sync.reload.state import get_state, has_state
from weight_sync.reload.validation import plan_missing

__all__ = [
    "audit_ahead",
    "begin_update",
    "declare_loaded_layout",
    "finalize_layerwise_processing",
    "finalize_layerwise_reload",
    "forget_audit",
    "guarded_source",
    "initialize_layerwise_reload",
    "manifest_from_checkpoint",
    "record_metadata_for_reloading",
    "register_update_hook",
    "reload_weights",
    "unregister_update_hook",
]


class UpdateHook(Protocol):
    """Storage that is not the model's own tensors takes part in an update (DLO's host storage).

    ``before_begin(model)`` runs before the session exists: it may present other tensors as the
    model's kernel tensors (the session snapshots pointers after it) or raise to refuse the update
    before anything is written. ``opened(session)`` runs once the session is open; ``closed(session)``
    once it ended (finished or aborted; ``session`` None when it could not be opened).
    """

    def before_begin(self, model: nn.Module) -> None: ...
    def opened(self, session: UpdateSession) -> None: ...
    def closed(self, session: UpdateSession | None) -> None: ...


_UPDATE_HOOKS: weakref.WeakKeyDictionary[nn.Module, list[UpdateHook]] = weakref.WeakKeyDictionary()


def register_update_hook(model: nn.Module, hook: UpdateHook) -> None:
    """Run ``hook`` around every update begun on ``model`` (see :class:`UpdateHook`)."""
    _UPDATE_HOOKS.setdefault(model, []).append(hook)


def unregister_update_hook(model: nn.Module, hook: UpdateHook) -> None:
    """Stop running ``hook`` for ``model``'s updates (no-op if it was not registered)."""
    hooks = _UPDATE_HOOKS.get(model, [])
    if hook in hooks:
        hooks.remove(hook)


def audit_ahead(model: nn.Module) -> bool:
    """Re-check now that nothing moved since ``model``'s last committed update, for its next begin only.

    A receiver calls it while it waits for the sender's header (time it would otherwise idle), so that
    begin, which is on the update's critical path, skips the same re-check (``audit.still_holds``: ~0.5 ms
    for an 8B model's 400 tensors). The verdict is used by the very next :func:`begin_update` on ``model``
    and must be dropped with :func:`forget_audit` when that begin does not follow at once: a change made
    between the two would otherwise go unnoticed at begin (the re-check at finish still refuses it, as
    it refuses a change made during an update). Nothing is checked ahead, and False returned, when the
    model has no committed baseline or an update hook runs before begin (it may present other tensors).
    """
    state = get_state(model) if has_state(model) else None
    if state is None or state.active is not None or _UPDATE_HOOKS.get(model):
        return False
    kept = state.last_baseline
    state.audited_ahead = kept if kept is not None and still_holds(kept, model) else None
    return state.audited_ahead is not None


def forget_audit(model: nn.Module) -> None:
    """Drop a verdict of :func:`audit_ahead` that no begin used (the next begin re-checks)."""
    if has_state(model):
        get_state(model).audited_ahead = None


def record_metadata_for_reloading(model: nn.Module) -> None:
    """Record every layer's model-format tensors (class, layout, loader attributes) for later reloads.

    Call it right after the model is built, before any processing: it is what lets reload rebuild a
    quantized layer's full-precision form. Calling it again is a no-op.
    """
    get_state(model, create=True)


def begin_update(
    model: nn.Module,
    manifest: Manifest | Iterable[TensorMeta] | None = None,
    *,
    budget_bytes: int | None = None,
    rollback: bool = False,
    version: Any = None,
    allow_partial: bool = False,
    fingerprint: bool = True,
) -> UpdateSession:
    """Open an update on ``model``; a manifest is validated against the plan before anything is written.

    budget_bytes: cap on model-format staging of pending layers on the model's device (default: the
    largest block); beyond it staging goes to host memory. rollback: snapshot each layer to host before
    its first write, so a failure restores the model bitwise (else a failure marks it torn).
    allow_partial: accept an update that covers only some tensors. fingerprint: hash the kernel
    tensors into the report at finish.
    """
    if manifest is not None and not isinstance(manifest, Manifest):
        manifest = Manifest(tuple(manifest), version=version)
    state = get_state(model, create=True)
    hooks = list(_UPDATE_HOOKS.get(model, ()))
    if state.active is not None:
        hooks = []  # the session below refuses to open; the hooks must not touch the open one's storage
    for hook in hooks:
        hook.before_begin(model)
    try:
        session = UpdateSession(
            model, state, manifest=manifest, budget_bytes=budget_bytes, rollback=rollback,
            version=version, allow_partial=allow_partial, compute_fingerprint=fingerprint,
        )
    except BaseException:
        for hook in hooks:
            hook.closed(None)
        raise
    for hook in hooks:
        hook.opened(session)
        session.on_close(lambda hook=hook: hook.closed(session))  # type: ignore[misc]
    return session


def declare_loaded_layout(model: nn.Module, manifest: Manifest) -> list[str]:
    """Declare the checkpoint layout another loader (vLLM's) filled ``model`` from: the first
    weight_sync update is then held to it, as later ones are held to the last complete update.

    Without it, the first update after a foreign load has nothing to be checked against: one that
    covers only some layers would leave the others as they were (a mix), and a tensor larger than the
    parameter could pass where the model's loader narrows it (vLLM's TP=1 loaders take the first rows).
    The announced keys are planned now (a dry run on meta tensors: nothing is written); keys the model's
    loaders refuse are left out and returned. A model that already has a reference keeps it.
    """
    state = get_state(model, create=True)
    if state.reference is not None:
        return []
    if state.plan is None:
        state.plan = Plan()
    problems = plan_missing(model, state, state.plan, list(manifest))
    state.reference = Manifest(tuple(TensorMeta(m.name, m.dtype, m.shape) for m in manifest
                                     if m.name not in problems))
    return sorted(problems)


def manifest_from_checkpoint(path: str | os.PathLike, *, version: Any = None) -> Manifest:
    """Names, dtypes and shapes of every tensor of a local checkpoint (safetensors: headers only; torch
    files: mapped, no weight read), before any data is touched."""
    return Manifest(tuple(checkpoint_metas(path)), version=version)


def reload_weights(
    model: nn.Module,
    *,
    weights_path: str | os.PathLike | None = None,
    weights_iterator: Iterable[tuple[str, torch.Tensor]] | None = None,
    manifest: Manifest | None = None,
    progress: bool = False,
    **options: Any,
) -> UpdateReport:
    """Update ``model`` from a local checkpoint (mapped, streamed in layer order) or an iterable.

    ``weights_path``: a directory or file of safetensors, or of torch files (``pytorch_model*.bin``,
    ``*.pt``, read with ``torch.load(weights_only=True)``). The manifest comes from the checkpoint before
    any weight is read, so the whole checkpoint is validated before the first write. ``progress`` shows a progress bar over the tensors (on a terminal). Options are those
    of :func:`begin_update`.
    """
    if (weights_path is None) == (weights_iterator is None):
        raise ValueError("reload_weights needs exactly one of weights_path or weights_iterator")
    if weights_path is not None:
        manifest = manifest_from_checkpoint(weights_path, version=options.get("version"))
    session = begin_update(model, manifest, **options)
    if weights_path is not None:
        mapped = map_checkpoint(weights_path)
        # Layer order from the plan: each layer's keys arrive together, so at most one layer is pending.
        source: Iterable[tuple[str, torch.Tensor]] = (
            (n, mapped[n]) for n in session.layer_order(mapped)
        )
    else:
        assert weights_iterator is not None
        source = weights_iterator
    if progress:
        from tqdm.auto import tqdm

        total = len(session.manifest) if session.manifest is not None else None
        source = tqdm(source, total=total, unit="tensor", desc="loading weights", leave=False)
    with session:
        for item in guarded_source(source):
            session.load((item,))
        return session.finish()


def guarded_source(source: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Yield ``source``'s items; a failure of the source itself becomes a SourceError naming the last
    tensor it produced (errors weight_sync raised on purpose pass through unchanged)."""
    last = None
    it = iter(source)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except WeightSyncError:
            raise
        except Exception as e:
            where = f"after {last!r}" if last else "before the first tensor"
            raise SourceError(f"the weights source failed {where}: {type(e).__name__}: {e}") from e
        yield item
        last = item[0]


def initialize_layerwise_reload(model: nn.Module, **options: Any) -> UpdateSession:
    """Open an update and route ``model.load_weights(...)`` and every parameter's ``weight_loader``
    into it until the update ends (a direct ``param.weight_loader(param, w, shard_id)`` call loads the
    checkpoint tensor that makes that call: see :mod:`weight_sync.reload.loaders`).

    The routing lasts as long as the session: finalized, or aborted because a ``load_weights`` call
    failed (the model is then rolled back or torn, as ``rollback`` says), ``model.load_weights`` is the
    model's own again and the next ``initialize_layerwise_reload`` starts afresh.
    """
    session = begin_update(model, options.pop("manifest", None), **options)
    had_own = "load_weights" in model.__dict__
    original = model.__dict__.get("load_weights")

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        session.load(weights)
        return set()

    def unroute() -> None:
        model.__dict__.pop("_ws_saved_load_weights", None)
        if had_own:
            model.__dict__["load_weights"] = original
        else:
            model.__dict__.pop("load_weights", None)

    # The session's own fallback calls the class's load_weights, never this instance attribute.
    model.__dict__["_ws_saved_load_weights"] = original
    model.__dict__["load_weights"] = load_weights
    session.on_close(unroute)
    # As vLLM's version does, every parameter's weight_loader is part of the reload too.
    session.on_close(route_weight_loaders(session))
    return session


def finalize_layerwise_processing(model: nn.Module, model_config: Any = None) -> UpdateReport:
    """Commit the update opened by :func:`initialize_layerwise_reload` and restore ``load_weights``.

    ``model_config`` is accepted for vLLM's signature and not used: vLLM needs it to hand the model's
    dtype to attention layers' processing, which weight_sync's vLLM hooks record once when the model
    is set up, and every other layer is processed as soon as its last tensor arrives.
    """
    state = get_state(model) if has_state(model) else None
    if state is None or state.active is None:
        last = f" ({state.last_abort})" if state is not None and state.last_abort else ""
        raise UpdateStateError(f"finalize_layerwise_processing: no layerwise reload is in progress{last}")
    session: UpdateSession = state.active
    return session.finish()


def finalize_layerwise_reload(model: nn.Module, model_config: Any = None) -> UpdateReport:
    """vLLM's other name for :func:`finalize_layerwise_processing` (same behaviour)."""
    return finalize_layerwise_processing(model, model_config)
