"""vLLM's model as weight_sync sees it: recording at construction, processors, attention, fingerprint.

*Recording.* weight_sync must capture every layer's model-format tensors right after the model class is
built, before loading and processing (afterwards, CPU linears hold empty weights and fp8 layers fp8 ones).
vLLM records its own metadata at exactly that point by calling
``vllm.model_executor.model_loader.utils.record_metadata_for_reloading``; :func:`recording_model_format`
wraps that function for the duration of one ``load_model`` so weight_sync records at the same moment,
whatever loader or load format the engine uses.

*Processors.* A layer with a vLLM quant method is processed the way vLLM's own loader does it
(``process_weights_after_loading`` then ``update_param_tp_status``); on CUDA-like platforms unquantized
linear and embedding methods process nothing, so those layers take weight_sync's direct path (written in
place, no staging). Attention layers are processed with the model dtype, and once more after every update
(vLLM processes them last because they may derive state from other layers); tensors they recreate are
copied into the existing ones so captured graphs keep their pointers.

*Fingerprint.* A hash of every graph-visible tensor except KV caches (which change with every request).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import weight_sync
from weight_sync.checkpoints import resolve_checkpoint
from weight_sync.errors import LayoutMismatchError, WeightSyncError
from weight_sync.layers import graph_visible_tensors
from weight_sync.manifest import dtype_to_str, tensor_checksum
from weight_sync.reload import (
    declare_loaded_layout,
    manifest_from_checkpoint,
    mark_layers_processed,
    register_direct_method,
    register_post_update_hook,
)

__all__ = [
    "kernel_fingerprint",
    "last_report",
    "prepare_loaded_model",
    "record_report",
    "recording_model_format",
]

log = logging.getLogger(__name__)

# Attributes an attention layer holds that are not weights: the KV cache views bound after allocation.
KV_CACHE_ATTRS = _KV_CACHE_ATTRS = frozenset({"kv_cache"})

# Unquantized methods whose processing is a no-op on CUDA-like platforms (on CPU they prepack for oneDNN).
_NOOP_ON_CUDA = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
# On CPU the same methods only read the model-format weight (``dispatch_cpu_unquantized_gemm`` packs a
# copy into a oneDNN / SGL handle, or serves the weight tensor itself, which reload copies into the live
# one), so reload may process them straight from the caller's tensor. A path that keeps the weight (zen
# without prepacking) is caught when it happens and the layer falls back to copies.
_READS_INPUT_ON_CPU = _NOOP_ON_CUDA


def _process_with_quant_method(module: nn.Module) -> None:
    """Process a layer the way vLLM's loader does: the quant method, then TP status reconciliation."""
    module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]
    # Processing may install fresh Parameters stamped with the global rank; vLLM re-reconciles their TP
    # state right after, or a later reload narrows replicated weights at the wrong offset.
    update = getattr(module, "update_param_tp_status", None)
    if callable(update):
        update()


class _AttentionProcessor:
    """Attention layers take the activation dtype as an argument."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module) -> None:
        module.process_weights_after_loading(self.dtype)  # type: ignore[operator]


def _unwrap_loader(loader: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's online quantization wraps loaders in `online_process_loader`, which buffers into vLLM's own
    # layerwise state; weight_sync must record (and later call) the loader underneath.
    while getattr(loader, "__name__", "") == "online_process_loader" and hasattr(loader, "__wrapped__"):
        loader = loader.__wrapped__
    return loader


def _declare_processors(model: nn.Module, dtype: torch.dtype) -> None:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        for name in _NOOP_ON_CUDA:
            register_direct_method(name)
    for mod in model.modules():
        if is_deferred_attention_layer(mod):
            mod.ws_processor = _AttentionProcessor(dtype)  # type: ignore[assignment]
            continue
        qm = getattr(mod, "quant_method", None)
        if not isinstance(qm, QuantizeMethodBase):
            continue
        if current_platform.is_cuda_alike() and type(qm).__name__ in _NOOP_ON_CUDA:
            continue  # direct path (registered above)
        mod.ws_processor = _process_with_quant_method  # type: ignore[assignment]
        if current_platform.is_cpu() and type(qm).__name__ in _READS_INPUT_ON_CPU:
            mod.ws_processor_reads_input = True  # type: ignore[assignment]
    # Fused experts need more than their quant method on updates (see integrations/vllm/moe.py).
    from weight_sync.integrations.vllm.moe import declare_fused_moe_processors

    declare_fused_moe_processors(model)


def _record(model: nn.Module, dtype: torch.dtype) -> None:
    _declare_processors(model, dtype)
    wrapped: list[tuple[torch.Tensor, Callable[..., Any]]] = []
    for mod in model.modules():
        for p in list(mod._parameters.values()) + list(mod._buffers.values()):
            if p is None:
                continue
            loader = getattr(p, "weight_loader", None)
            if loader is not None and _unwrap_loader(loader) is not loader:
                wrapped.append((p, loader))
                p.weight_loader = _unwrap_loader(loader)  # type: ignore[attr-defined]
    try:
        weight_sync.record_metadata_for_reloading(model)
    finally:
        for p, loader in wrapped:
            p.weight_loader = loader  # type: ignore[attr-defined]


@contextlib.contextmanager
def recording_model_format(vllm_config: Any) -> Iterator[list[nn.Module]]:
    """While active, every model vLLM builds is also recorded by weight_sync (yields those models)."""
    from vllm.model_executor.model_loader import utils as loader_utils

    original = getattr(loader_utils, "record_metadata_for_reloading", None)
    if original is None:
        raise RuntimeError(
            "vllm.model_executor.model_loader.utils.record_metadata_for_reloading is missing; this vLLM "
            "version records reload metadata elsewhere and weight_sync cannot hook model construction"
        )
    built: list[nn.Module] = []
    dtype = vllm_config.model_config.dtype

    def record_both(model: nn.Module) -> None:
        original(model)
        _record(model, dtype)
        built.append(model)

    loader_utils.record_metadata_for_reloading = record_both
    try:
        yield built
    finally:
        loader_utils.record_metadata_for_reloading = original


def _refresh_attention(model: nn.Module, dtype: torch.dtype) -> Callable[[nn.Module], None]:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    # Found once: walking every module on every update costs more than the refresh itself.
    layers = [(name, mod) for name, mod in model.named_modules() if is_deferred_attention_layer(mod)]

    def refresh(model: nn.Module) -> None:
        for name, mod in layers:
            before = {k: t for k, t in graph_visible_tensors(mod).items() if k not in _KV_CACHE_ATTRS}
            mod.process_weights_after_loading(dtype)
            after = graph_visible_tensors(mod)
            for k, old in before.items():
                new = after.get(k)
                if new is None or new is old:
                    continue
                if tuple(new.shape) != tuple(old.shape) or new.dtype != old.dtype:
                    raise LayoutMismatchError(
                        f"{name}.{k}: attention processing replaced a {tuple(old.shape)} {old.dtype} "
                        f"tensor with {tuple(new.shape)} {new.dtype}; it cannot be copied in place"
                    )
                with torch.no_grad():
                    old.copy_(new)
                # Reinstall the old object under its old role so graphs keep pointing at it.
                if k in mod._parameters:
                    mod._parameters[k] = old  # type: ignore[assignment]
                elif k in mod._buffers:
                    mod._buffers[k] = old
                else:
                    mod.__dict__[k] = old

    return refresh


def prepare_loaded_model(
    model: nn.Module, vllm_config: Any, *, dtype: torch.dtype | None = None, model_config: Any = None
) -> None:
    """After vLLM's first load: declare the layers kernel format, re-process attention after updates,
    and hold the first update to the checkpoint vLLM loaded.

    ``dtype`` / ``model_config``: the model's activation dtype and config, when they are not the
    engine's (a draft model has its own model config).
    """
    mark_layers_processed(model)
    register_post_update_hook(
        model, _refresh_attention(model, vllm_config.model_config.dtype if dtype is None else dtype)
    )
    _hold_to_loaded_checkpoint(model, model_config or vllm_config.model_config,
                               getattr(vllm_config, "load_config", None))


def _hold_to_loaded_checkpoint(model: nn.Module, model_config: Any, load_config: Any) -> None:
    """The checkpoint vLLM loaded becomes the layout the first update must cover, each tensor in its
    shape (see :func:`weight_sync.reload.declare_loaded_layout`). Dummy weights, or a checkpoint that is
    not local, leave the first update checked against the plan only (as before), said in the log."""
    load_format = str(getattr(load_config, "load_format", "auto")).lower()
    if "dummy" in load_format:
        return
    try:
        path = resolve_checkpoint(model_config.model, revision=getattr(model_config, "revision", None))
        manifest = manifest_from_checkpoint(path)
    except WeightSyncError as e:
        log.info("%s: the first update is checked against the model's plan only (%s)",
                 type(model).__name__, e)
        return
    dropped = declare_loaded_layout(model, manifest)
    if dropped:
        log.info("%s: %d checkpoint tensor(s) the model's loaders refuse are not required of updates: %s",
                 type(model).__name__, len(dropped), ", ".join(dropped[:4]))


def kernel_fingerprint(model: nn.Module) -> str:
    """SHA-256 over names, dtypes, shapes and checksums of every graph-visible tensor but KV caches.

    Equal fingerprints mean bitwise-equal kernel tensors. Limitation: state that is not a tensor (CPU
    oneDNN handles of prepacked linear weights) is not covered.
    """
    h = hashlib.sha256()
    items: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for t_name, t in graph_visible_tensors(mod).items():
            if t_name in _KV_CACHE_ATTRS or id(t) in seen or t.device.type == "meta":
                continue
            seen.add(id(t))
            items.append((f"{mod_name}.{t_name}" if mod_name else t_name, t))
    for name, t in sorted(items, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(dtype_to_str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(tensor_checksum(t).to_bytes(8, "little", signed=False))
    return h.hexdigest()


# The last committed update's report per model, whichever path (reload RPC or transfer) committed it.
_LAST_REPORTS: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def record_report(model: nn.Module, report: dict[str, Any]) -> None:
    """Remember ``report`` (JSON-able) as the last committed update of ``model``."""
    _LAST_REPORTS[model] = report


def last_report(model: nn.Module) -> dict[str, Any] | None:
    """The last committed update's report of ``model``, or None before the first update."""
    return _LAST_REPORTS.get(model)
