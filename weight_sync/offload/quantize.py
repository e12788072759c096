"""Online quantization of the blocks DLO takes over: block linears become kernel format before packing.

With ``OffloadConfig.quantization`` set (a quant-registry name: ``fp8``, ``fp8_per_channel``,
``fp8_block``, ``int8``, ...), ``enable_layerwise_offload`` replaces every ``nn.Linear`` of every block
(streamed and resident) by a :class:`~weight_sync.quant.modules.QuantizedLinear` built from the host weights,
before the blocks are laid out. The replacement runs the registry's processor, so the bytes are exactly
those the reference engine's online quantization produces. From then on the quantized weight, its fp32
scales and the unprocessed bias are ordinary tensors of the block: they are packed into the host store,
streamed into a slot and re-pointed like any other, and the module's ``forward`` computes from the slot
views (``LinearMethod.apply``: dequantize + matmul, or ``torch._scaled_mm`` on CUDA).

The replacement is undone (:meth:`BlockQuantization.revert`) if enabling fails before the model is
committed to offload (a schedule that differs across the gather group, a tied tensor), so such a failure
leaves the model as it was. Once the host store holds the quantized bytes, the full-precision weights
are released (:meth:`BlockQuantization.commit`).

Updates requantize. Each replacement's *model format* (the original linear's ``weight`` / ``bias``
records: class, shape, dtype, stride) is remembered here, because the reload lifecycle records a layer
as it finds it and would otherwise take the kernel-format fp8 tensors for the model format (and "update"
them with a cast). :func:`declare_requantization` tells a model's reload state, before an update's
session opens, that every ``QuantizedLinear`` is a processed layer: its keys fill full-precision staging,
the registry's processor quantizes it when its last key arrives, and the results are copied into the
kernel tensors that exist (the host views the offload updater presents), so the bytes are those a fresh
load quantized the same way would hold.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.layers.meta import TensorRecord, capture_layer

__all__ = ["BlockQuantization", "declare_requantization", "quantize_blocks"]

# QuantizedLinear -> the model-format records of the nn.Linear it replaced (weak: it goes with the module).
_MODEL_FORMAT: weakref.WeakKeyDictionary[nn.Module, dict[str, TensorRecord]] = weakref.WeakKeyDictionary()


@dataclass
class BlockQuantization:
    """The linears of the blocks replaced by quantized ones; ``revert`` puts the originals back."""

    name: str  # as configured ("fp8_block")
    method: str  # the linear method it resolves to ("fp8_block"; "fp8" and "fp8_per_tensor": "fp8_tensor")
    num_linears: int
    # ids of the tensors the processor produced (quantized weights and scales): host memory of this
    # process, not part of any file mapping the host weights came from.
    produced_ids: frozenset[int]
    _swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = field(default_factory=list, repr=False)

    def revert(self) -> None:
        """Put every original ``nn.Linear`` back (before the offload is committed)."""
        for parent, attr, original, _ in reversed(self._swaps):
            setattr(parent, attr, original)
        self._swaps.clear()

    def commit(self) -> None:
        """Forget the originals, so their full-precision weights can be freed."""
        self._swaps.clear()


def quantize_blocks(blocks: Sequence[tuple[str, nn.Module]], name: str) -> BlockQuantization:
    """Quantize every ``nn.Linear`` of ``blocks`` with the registry's processor for ``name``."""
    # Lazily: only quantized offloads need the quant package.
    from weight_sync.quant.modules import QuantizedLinear, quantize_linears


    swaps: list[tuple[nn.Module, str, nn.Module, nn.Module]] = []
    try:
        for _, block in blocks:
            swaps.extend(quantize_linears(block, name))
        for _, _, original, q in swaps:
            # Staging only (QuantizedLinear is inference-only): no gradients on the model-format tensors.
            _MODEL_FORMAT[q] = {
                n: dataclasses.replace(r, requires_grad=False) for n, r in capture_layer(original).items()
            }
    except BaseException:
        for parent, attr, original, _ in reversed(swaps):
            setattr(parent, attr, original)
        raise
    already = [m for _, block in blocks for m in block.modules() if isinstance(m, QuantizedLinear)]
    if blocks and not swaps and already:
        # Quantized before (an offload enabled again after ``disable()``, which keeps kernel format):
        # nothing to do if it is the same scheme, an error otherwise (the full-precision bytes are gone).
        methods = {m.quant_method.name for m in already}
        wanted = QuantizedLinear.method_name(name)
        if methods != {wanted}:
            raise ConfigError(
                f"quantization={name!r} ({wanted}): the offloaded blocks are already quantized with "
                f"{sorted(methods)} and hold no full-precision linear to quantize again"
            )
        ids = frozenset(id(t) for m in already for t in (m.weight, m.weight_scale))
        return BlockQuantization(name, wanted, len(already), ids)
    if blocks and not swaps:
        raise ConfigError(
            f"quantization={name!r}: the {len(blocks)} offloaded blocks (first: {blocks[0][0]!r}) contain "
            "no nn.Linear to quantize; pass quantization=None"
        )
    produced = frozenset(
        id(t) for _, _, _, q in swaps for t in (q.weight, q.weight_scale)  # type: ignore[union-attr]
    )
    method = swaps[0][3].quant_method.name if swaps else name  # type: ignore[union-attr]
    return BlockQuantization(name, str(method), len({id(q) for *_, q in swaps}), produced, swaps)


def declare_requantization(model: nn.Module, *, strict: bool = True) -> list[str]:
    """Make every ``QuantizedLinear`` of ``model`` a requantizing layer of its reload state; their names.

    Idempotent; called before each update's session opens, and by ``disable()`` (the resident model keeps
    kernel format). A layer recorded earlier (as the ``nn.Linear`` it was, or as its kernel-format
    tensors) is re-declared, and a plan made from the old records is dropped (made again from the new
    records by the same dry run, before any write). ``strict``: a ``QuantizedLinear`` whose model format
    is unknown (not quantized by an offload) is an error; otherwise it is left as the state has it.
    """
    from weight_sync.layers.blocks import block_key
    from weight_sync.quant.modules import QuantizedLinear
    from weight_sync.reload.state import LayerInfo, get_state

    state = get_state(model, create=True)
    names: list[str] = []
    seen: set[int] = set()
    changed = False
    for name, mod in model.named_modules():
        if not isinstance(mod, QuantizedLinear) or id(mod) in seen:
            continue
        seen.add(id(mod))
        records = _MODEL_FORMAT.get(mod)
        if records is None and not strict:
            continue
        if records is None:
            raise ConfigError(
                f"{name}: a QuantizedLinear ({mod.quant_method.name}) whose full-precision layout is "
                "unknown (it was not quantized by enable_layerwise_offload's quantization=), so an "
                "update cannot requantize it; quantize the blocks through OffloadConfig.quantization"
            )
        names.append(name)
        info = state.layers.get(name)
        if info is not None and info.module is mod and info.records is records and info.processed:
            continue
        method = mod.quant_method
        state.layers[name] = LayerInfo(
            name=name,
            module=mod,
            records=records,
            processor=method.process_weights_after_loading,
            block=block_key(f"{name}.x").name,
            initial_attrs=frozenset(vars(mod)),
            # Kernel tensors exist: the processor's outputs are copied into them (never replace them).
            processed=True,
            # The online processors only read the weight: a tensor that arrives whole is quantized where
            # it lies (a transport bucket) instead of from a staging copy.
            reads_input=bool(getattr(method, "processor_reads_input", False)),
        )
        changed = True
    if changed and state.plan is not None:
        state.plan = None
        state.accepted = None
        state.views.clear()
    return names
