"""Per-model reload state: model-format records per layer, the plan, the torn flag, post-update hooks.

State lives in a WeakKeyDictionary keyed by the model, so weight_sync never adds attributes a model's own
code could trip over and a model that goes away takes its state with it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from weight_sync.errors import (
    LayoutMismatchError,
    TornModelError,
    UnknownTensorError,
    UpdateStateError,
)
from weight_sync.layers.blocks import block_key
from weight_sync.layers.loading import check_loadable
from weight_sync.layers.meta import TensorRecord, capture_layer, records_nbytes
from weight_sync.layers.tensors import graph_visible_tensors

if TYPE_CHECKING:
    import torch

    from weight_sync.manifest import Manifest, TensorMeta
    from weight_sync.reload.plan import Plan

__all__ = [
    "AcceptedManifest",
    "LayerInfo",
    "ModelState",
    "check_servable",
    "get_state",
    "name_list",
    "register_direct_method",
    "register_post_update_hook",
    "torn_reason",
]

_STATES: weakref.WeakKeyDictionary[nn.Module, ModelState] = weakref.WeakKeyDictionary()

# Class names of foreign linear methods whose processing is known to be a no-op, so their layers can take
# the direct path (integrations register theirs; unknown methods are assumed to process).
_DIRECT_METHODS: set[str] = set()


def register_direct_method(cls_name: str) -> None:
    """Declare that layers using the method class ``cls_name`` need no processing after loading."""
    _DIRECT_METHODS.add(cls_name)


@dataclass(slots=True)
class LayerInfo:
    """One layer (a module that owns tensors) and how reload treats it."""

    name: str
    module: nn.Module
    records: dict[str, TensorRecord]
    processor: Callable[[nn.Module], None] | None
    block: str
    initial_attrs: frozenset[str] = frozenset()
    # False until the layer has been processed once: its live tensors are then model format (or meta)
    # and the processor's outputs become the kernel tensors instead of being copied into them.
    processed: bool = False
    # The processor only reads its model-format tensors (never writes them, never keeps a reference), so
    # a tensor that arrives whole can be processed where it lies instead of from a copy. Declared by
    # ``module.ws_processor_reads_input = True``; cleared if processing is ever seen keeping its input.
    reads_input: bool = False
    # Processes the layer unit by unit (one expert at a time) on reloads: ``fn(module, units, staging,
    # targets)``, see :mod:`weight_sync.reload.units`; None for processing that is layer-wide.
    unit_processor: Callable[..., None] | None = None
    _nbytes: int | None = None

    @property
    def direct(self) -> bool:
        return self.processor is None

    @property
    def model_format_bytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = records_nbytes(self.records)
        return self._nbytes


@dataclass(frozen=True, slots=True)
class AcceptedManifest:
    """The last manifest that passed validation, with what it was checked against and derived from it."""

    tensors: tuple[TensorMeta, ...]
    allow_partial: bool
    reference: Manifest | None
    plan_size: int
    expected: frozenset[str]
    announced: dict[str, tuple[torch.Size, torch.dtype]]


@dataclass(slots=True)
class ModelState:
    """Everything reload remembers about one model between updates."""

    layers: dict[str, LayerInfo]
    plan: Plan | None = None
    # The layout every full update covers; it grows with updates that announce more, never shrinks.
    reference: Manifest | None = None
    # (reference, announced entries) last found equal at a commit: an update that announces the same
    # ``Manifest.tensors`` object against the same reference needs no comparison at its commit.
    reference_matched: tuple[Manifest, tuple[Any, ...]] | None = None
    # Torn: layers written by failed updates (neither rolled back nor rewritten by a committed update
    # since) and why. The model serves only while ``torn_layers`` is empty.
    torn: str | None = None
    torn_layers: set[str] = field(default_factory=set)
    version: Any = None
    active: Any = None  # the open UpdateSession, if any
    # How the last update ended, when it was aborted (named by later lifecycle errors).
    last_abort: str | None = None
    post_update_hooks: list[Callable[[nn.Module], None]] = field(default_factory=list)
    # Destination views of planned keys into direct layers, reused across updates while the
    # signatures taken at the end of the last update still hold.
    views: dict[str, Any] = field(default_factory=dict)
    # Bumped whenever ``views`` is cleared: a replay record made at another epoch may hold stale views.
    views_epoch: int = 0
    # Lists of keys into direct layers recorded for replay, by their names (reload/replay.py).
    replays: dict[tuple[str, ...], Any] = field(default_factory=dict)
    last_signatures: dict[str, Any] = field(default_factory=dict)
    # The pointer-audit baseline the last committed update verified (reload/audit.py), re-checked
    # instead of walking the model again at the next begin; None after a first processing or an abort.
    last_baseline: Any = None
    # ``last_baseline`` when :func:`weight_sync.reload.api.audit_ahead` found it still holding, for the
    # next begin only (a receiver checks it while it waits for the sender's header, then forgets it).
    audited_ahead: Any = None
    # Small copies and band quantizations queued within one load call (reload/writes.py).
    write_queue: Any = None
    # Validation is repeated only when an update announces something else (see UpdateSession).
    accepted: AcceptedManifest | None = None

    def tear(self, layers: Iterable[str], reason: str) -> None:
        """Record that a failed update left ``layers`` holding bytes of no committed version."""
        layers = set(layers)
        if layers:
            self.torn_layers |= layers
            self.torn = reason

    def mend(self, rewritten: Iterable[str]) -> None:
        """A committed update rewrote ``rewritten`` whole: those layers hold its version again."""
        if self.torn_layers:
            self.torn_layers.difference_update(rewritten)
            if not self.torn_layers:
                self.torn = None

    def forget_views(self) -> None:
        """Drop every cached destination view (something may have moved); records made before go stale."""
        self.views.clear()
        self.views_epoch += 1

    def largest_block_bytes(self) -> int:
        """Model-format bytes of the processed layers of the largest block (the default budget)."""
        per_block: dict[str, int] = {}
        largest_layer = 0
        for info in self.layers.values():
            if info.direct:
                continue
            n = info.model_format_bytes
            per_block[info.block] = per_block.get(info.block, 0) + n
            largest_layer = max(largest_layer, n)
        return max([largest_layer, *per_block.values()])


def _processor_for(module: nn.Module) -> Callable[[nn.Module], None] | None:
    """How a layer is processed after loading: ``fn(module)``, or None for the direct path.

    In order: an explicit ``module.ws_processor``; the module's ``quant_method`` (vLLM convention),
    unless it declares ``requires_processing = False`` or is registered direct; the module's own
    ``process_weights_after_loading()``; otherwise no processing.
    """
    explicit = getattr(module, "ws_processor", None)
    if explicit is not None:
        return explicit
    qm = getattr(module, "quant_method", None)
    if qm is not None:
        needs = getattr(qm, "requires_processing", None)
        if needs is False or type(qm).__name__ in _DIRECT_METHODS:
            return None
        return qm.process_weights_after_loading
    if getattr(type(module), "process_weights_after_loading", None) is not None:
        return _call_own_processor
    return None


def _unit_processor_for(module: nn.Module, processor: Callable[[nn.Module], None] | None) -> Callable[..., None] | None:
    """The per-unit processor belonging to ``processor`` (see :mod:`weight_sync.reload.units`), if any.

    ``module.ws_process_units`` wins; otherwise the ``process_units`` of the quant method whose
    ``process_weights_after_loading`` is the processor (a hook of another method would process
    differently from the layer's own processing).
    """
    if processor is None:
        return None
    explicit = getattr(module, "ws_process_units", None)
    if explicit is not None or getattr(module, "ws_processor", None) is not None:
        return explicit
    qm = getattr(module, "quant_method", None)
    fn = getattr(qm, "process_units", None)
    if fn is None or processor != qm.process_weights_after_loading:  # type: ignore[union-attr]
        return None
    return fn  # type: ignore[no-any-return]


def _call_own_processor(module: nn.Module) -> None:
    module.process_weights_after_loading()  # type: ignore[operator]


def record_layers(model: nn.Module) -> dict[str, LayerInfo]:
    """Capture model-format records of every layer of ``model`` (call right after construction)."""
    layers: dict[str, LayerInfo] = {}
    seen: set[int] = set()
    for name, mod in model.named_modules():
        if not graph_visible_tensors(mod):
            continue
        records = capture_layer(mod)
        # A tensor shared by two layers (tied embeddings) belongs to the first one that owns it.
        own = {}
        for n, r in records.items():
            t = mod._parameters.get(n) if r.kind == "parameter" else mod._buffers.get(n)
            if t is not None and id(t) in seen:
                continue
            if t is not None:
                seen.add(id(t))
            own[n] = r
        if not own:
            continue
        processor = _processor_for(mod)
        layers[name] = LayerInfo(
            name=name,
            module=mod,
            records=own,
            processor=processor,
            unit_processor=_unit_processor_for(mod, processor),
            block=block_key(f"{name}.x").name,
            initial_attrs=frozenset(vars(mod)),
            reads_input=getattr(mod, "ws_processor_reads_input", False) is True,
        )
    return layers


def mark_layers_processed(model: nn.Module) -> None:
    """Declare that ``model``'s layers already hold kernel-format tensors (loaded by another loader).

    Integrations call this when the engine's own loader did the first load and processing, so the next
    reload copies into the existing kernel tensors instead of replacing them.
    """
    for info in get_state(model).layers.values():
        info.processed = not info.direct


def get_state(model: nn.Module, *, create: bool = False) -> ModelState:
    """The reload state of ``model``; with ``create`` it is recorded now if it was not before."""
    state = _STATES.get(model)
    if state is None:
        if not create:
            raise UpdateStateError(
                f"{type(model).__name__} has no reload metadata: call "
                "record_metadata_for_reloading(model) right after building it"
            )
        state = ModelState(layers=record_layers(model))
        _STATES[model] = state
    return state


def _lookup(model: nn.Module, name: str) -> Any:
    """The parameter or buffer ``name`` as the model holds it *now* (O(depth), no full scan)."""
    prefix, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    t = mod._parameters.get(leaf)
    return t if t is not None else mod._buffers.get(leaf)


def default_load_weights(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> set[str]:
    """Loader for models without ``load_weights``: names are parameter/buffer names, loading is a copy."""
    loaded = set()
    for name, tensor in weights:
        dest = _lookup(model, name)
        if dest is None:
            raise UnknownTensorError(f"{name}: {type(model).__name__} has no parameter or buffer of this name")
        loader = getattr(dest, "weight_loader", None)
        try:
            if loader is not None:
                loader(dest, tensor)
            else:
                check_loadable(dest, tensor)
                dest.data.copy_(tensor)
        except LayoutMismatchError as e:
            raise LayoutMismatchError(f"{name}: {e}") from None
        loaded.add(name)
    return loaded


def model_load_weights(model: nn.Module) -> Callable[[Iterable[tuple[str, Any]]], Any]:
    """The model's own ``load_weights`` (not the routing shim ``initialize_layerwise_reload`` installs),
    or :func:`default_load_weights` for models that have none."""
    saved = model.__dict__.get("_ws_saved_load_weights")
    if saved is not None:
        return saved
    fn = getattr(type(model), "load_weights", None)
    if fn is not None:
        return fn.__get__(model)
    if "_ws_saved_load_weights" not in model.__dict__ and "load_weights" in model.__dict__:
        return model.__dict__["load_weights"]
    return lambda weights: default_load_weights(model, weights)


def has_state(model: nn.Module) -> bool:
    return model in _STATES


def name_list(items: Iterable[str], limit: int = 8) -> str:
    """The first ``limit`` names, sorted, and how many more there are."""
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def torn_reason(model: nn.Module) -> str | None:
    """Why the model is torn (a failed update left mixed weights), or None when it is servable.

    A model leaves the torn state only when every layer the failed update(s) wrote has been rewritten
    by a committed update (a full update always does; a partial one only for the layers it covers whole).
    """
    state = _STATES.get(model)
    if state is None or not state.torn_layers:
        return None
    return (f"{state.torn}; {len(state.torn_layers)} layer(s) not rewritten since: "
            f"{name_list(state.torn_layers, limit=4)}")


def check_servable(model: nn.Module) -> None:
    """Raise unless ``model`` holds exactly one committed version: no update open on it, not torn.

    An open update is refused rather than waited for: an engine process serves and receives on one
    thread, so waiting would never end, and half-written weights must never answer a request.
    """
    state = _STATES.get(model)
    if state is None:
        return
    if state.active is not None:
        raise UpdateStateError(
            f"update {state.active.version!r} is open on this model: its weights are half-written, so "
            "serving calls are refused until it is finished or aborted"
        )
    reason = torn_reason(model)
    if reason is not None:
        raise TornModelError(
            f"the model holds a mix of weight versions after a failed update ({reason}); it refuses to "
            "serve until an update rewrites what the failed one wrote (a full update always does)"
        )


def register_post_update_hook(model: nn.Module, hook: Callable[[nn.Module], None]) -> None:
    """Run ``hook(model)`` after every successful update (refresh state derived from weights)."""
    get_state(model, create=True).post_update_hooks.append(hook)
