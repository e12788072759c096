"""Fused-MoE expert methods: how an experts layer creates, processes and reads its stacked weights.

The vLLM convention (``FusedMoEMethodBase``): the layer owns ``w13_weight [E, 2I, H]`` (per expert: gate
rows, then up rows) and ``w2_weight [E, H, I]`` in model format, with the layer's expert ``weight_loader``.
``process_weights_after_loading`` turns them into kernel format, run by the reload lifecycle when the
layer's last expected key arrives (the first load); on reloads ``Fp8FusedMoEMethod.process_units``
quantizes each expert into the live kernel tensors as soon as its keys have arrived
(:mod:`weight_sync.reload.units`). :meth:`FusedMoEMethod.expert_weights`
gives one expert's two matrices in the activation dtype for the reference forward.

Online fp8 (vLLM's ``Fp8PerTensorOnlineMoEMethod`` / ``Fp8PerBlockOnlineMoEMethod``):

- ``granularity="tensor"``: ``w13_weight_scale [E]`` and ``w2_weight_scale [E]``, fp32, one scale per
  expert; w13's scale covers gate and up together (vLLM's online convention; fp8 *checkpoints* carry
  ``[E, 2]`` and are requantized to one). The absmax is MAX-reduced over the ranks that split the expert
  (TP inside experts), so every rank holds the scale an unsplit engine computes.
- ``granularity="block"``: ``w13_weight_scale_inv [E, ceil(2I/bn), ceil(H/bk)]`` and
  ``w2_weight_scale_inv [E, ceil(H/bn), ceil(I/bk)]`` (vLLM's name for block scales). Ragged edge tiles
  are zero-padded while scaling; vLLM rounds the sizes up to the block instead.

Limitations: per-channel fp8 and int8 experts are not implemented (refused with ConfigError); the
reference forward dequantizes one expert at a time (no fused fp8 kernel).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weight_sync.errors import ConfigError
from weight_sync.quant.base import layer_tensor, make_weight_param
from weight_sync.quant.fp8 import (
    FP8_MAX,
    Fp8Config,
    _absmax,
    _scale,
    band_functions,
    dequantize_fp8,
    quantize_fp8,
    quantize_fp8_bands,
    quantize_fp8_matrix_bands,
    tabled_fp8_matrix_bands,
)
from weight_sync.quant.online import (
    RELOAD_TARGETS,
    RowBands,
    fitting_output,
    reduce_max,
    split_over_group,
)
from weight_sync.quant.registry import resolve_quantization

__all__ = [
    "Fp8FusedMoEMethod",
    "FusedMoEMethod",
    "UnquantizedFusedMoEMethod",
    "make_moe_method",
    "quantize_fp8_experts",
]

WeightLoader = Callable[..., None]


class FusedMoEMethod:
    """Base class: model-format ``w13_weight`` / ``w2_weight`` and no processing."""

    #: False when kernel format equals model format, so reload writes checkpoint slices in place.
    requires_processing: bool = False
    name: str = "moe_unquantized"
    #: Where model-format weights are created: None = the layer's device; "meta" = materialized by the
    #: first load, so a quantized engine never holds the full-precision experts of the whole model.
    model_format_device: str | None = None

    def create_weights(
        self,
        layer: nn.Module,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
        device: torch.device | str,
    ) -> None:
        """Register ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` carrying the expert loader."""
        where = self.model_format_device or device
        i = intermediate_size_per_partition
        layer.register_parameter("w13_weight", make_weight_param(
            (num_experts, 2 * i, hidden_size), params_dtype, where, weight_loader))
        layer.register_parameter("w2_weight", make_weight_param(
            (num_experts, hidden_size, i), params_dtype, where, weight_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn model-format experts into kernel format (no-op when unquantized)."""

    def expert_weights(
        self, layer: nn.Module, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) of local expert ``expert`` as matrices in ``dtype``: [2I, H] and [H, I]."""
        return layer_tensor(layer, "w13_weight")[expert], layer_tensor(layer, "w2_weight")[expert]


class UnquantizedFusedMoEMethod(FusedMoEMethod):
    """Experts in the model's dtype; kernel format equals model format (the direct reload path)."""


class Fp8FusedMoEMethod(FusedMoEMethod):
    """Experts served from fp8 e4m3 weights quantized online, one expert at a time."""

    requires_processing = True
    model_format_device = "meta"

    def __init__(self, config: Fp8Config) -> None:
        if config.granularity not in ("tensor", "block"):
            raise ConfigError(
                f"fused MoE experts support fp8 granularity 'tensor' or 'block', got {config.granularity!r}"
            )
        self.config = config
        self.name = f"moe_fp8_{config.granularity}"
        # vLLM's names: weight_scale for per-tensor scales, weight_scale_inv for block scales.
        self.scale_name = "weight_scale" if config.granularity == "tensor" else "weight_scale_inv"
        # (staging/weight name, scale name) per stem, built once: process_units runs once per expert.
        self._unit_names = tuple((f"{stem}_weight", f"{stem}_{self.scale_name}") for stem in ("w13", "w2"))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w13, w2 = layer_tensor(layer, "w13_weight"), layer_tensor(layer, "w2_weight")
        if w13.dtype == torch.float8_e4m3fn:
            return  # already kernel format: processing twice would quantize quantized bytes
        # On a reload the live kernel tensors are offered: quantizing into them saves a transient copy
        # of every expert and the copy back.
        targets: dict[str, torch.Tensor] = getattr(layer, RELOAD_TARGETS, None) or {}
        group = getattr(layer, "moe_tp_group", None)
        for stem, w in (("w13", w13), ("w2", w2)):
            out = (targets.get(f"{stem}_weight"), targets.get(f"{stem}_{self.scale_name}"))
            q, scale = quantize_fp8_experts(w.detach(), self.config, group, out)
            setattr(layer, f"{stem}_weight", _param(q))
            setattr(layer, f"{stem}_{self.scale_name}", _param(scale))

    def process_units(
        self,
        layer: nn.Module,
        units: Sequence[int],
        staging: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
    ) -> None:
        """Quantize local experts ``units`` from their model-format ``staging`` into the live kernel tensors.

        The expert-granular reload hook (:mod:`weight_sync.reload.units`): ``staging`` holds
        ``w13_weight [len(units), 2I, H]`` and ``w2_weight [len(units), H, I]``; expert ``units[j]`` is
        written into ``targets[...][units[j]]`` with exactly the bytes and scale that processing the
        whole layer gives it. Per-tensor scales are MAX-reduced over the ranks that split the expert
        once per expert here: every rank completes experts in the order of the (identical) stream, so
        the collectives pair up.

        Each expert goes straight through :func:`~weight_sync.quant.fp8.quantize_fp8` - what
        :func:`quantize_fp8_experts` defines an expert's result as - on 2-D views of its slices: this
        runs once per expert of a reload, and there the 2-D quantizer costs a fraction of the host time
        of the stacked one (on CUDA one or two Triton kernels instead of a dozen torch ops; bitwise the
        same, as quantize_fp8 documents for its Triton path).
        """
        group = getattr(layer, "moe_tp_group", None)
        config, block = self.config, self.config.granularity == "block"
        # Block scales are per tile and never reduced over the group, as in quantize_fp8_experts.
        qgroup = None if block else group
        for w_name, s_name in self._unit_names:
            # Detached once per call, not per expert.
            w = staging[w_name].detach()
            qweight, scale = targets[w_name].detach(), targets[s_name].detach()
            for j, e in enumerate(units):
                # Block scales of one expert are [row tiles, col tiles]; a per-tensor scale stays 1-D.
                dq, ds = qweight[e], (scale[e] if block else scale[e : e + 1])
                q, s = quantize_fp8(w[j], config, qgroup, out=(dq, ds))
                if q.data_ptr() != dq.data_ptr():
                    dq.copy_(q)
                if s.data_ptr() != ds.data_ptr():
                    ds.copy_(s)

    def row_bands(self, layer: nn.Module, name: str, shape: tuple[int, ...]) -> RowBands | None:
        """Bands of an expert's rows (its gate or up half of ``w13``, its ``w2``): block scales quantize
        each on its own; a per-tensor scale per expert takes all of the expert's bands of the tensor at
        once (``RowBands.matrix_rows``), unless the experts are split over a TP group (the scale is then
        MAX-reduced over it, expert by expert in stream order: staged per unit instead)."""
        if name not in ("w13_weight", "w2_weight") or len(shape) != 3:
            return None
        per_tensor = self.config.granularity == "tensor"
        if per_tensor and split_over_group(getattr(layer, "moe_tp_group", None)):
            return None
        stem = name.removesuffix("_weight")
        scale_name = f"{stem}_{self.scale_name}"
        q, s = layer._parameters.get(name), layer._parameters.get(scale_name)
        bn, bk = self.config.block_size
        grid = (shape[0],) if per_tensor else (shape[0], -(-shape[1] // bn), -(-shape[2] // bk))
        if (q is None or s is None or q.dtype != torch.float8_e4m3fn or tuple(q.shape) != shape
                or not q.is_contiguous() or tuple(s.shape) != grid or not s.is_contiguous()):
            return None

        def target(layer: nn.Module, matrix: int, row: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            end = row + rows
            qm = layer._parameters[name].detach()[matrix, row:end]  # type: ignore[union-attr]
            sm = layer._parameters[scale_name].detach()  # type: ignore[union-attr]
            return qm, (sm[matrix : matrix + 1] if per_tensor else sm[matrix, row // bn : -(-end // bn)])

        if per_tensor:
            return RowBands(align=1, target=target, quantize=quantize_fp8_matrix_bands, matrix_rows=shape[1],
                            table=tabled_fp8_matrix_bands)
        quantize, table = band_functions(self.config)
        return RowBands(align=bn, target=target, quantize=quantize, table=table)

    def quantize_bands(self, items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Quantize each expert band (src, q, s) into its views (one grouped launch on CUDA)."""
        quantize_fp8_bands(items, self.config)

    def expert_weights(
        self, layer: nn.Module, expert: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for stem in ("w13", "w2"):
            q = layer_tensor(layer, f"{stem}_weight")[expert]
            scale = layer_tensor(layer, f"{stem}_{self.scale_name}")[expert]
            out.append(dequantize_fp8(q, scale, self.config, dtype))
        return out[0], out[1]


def _param(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False)


def quantize_fp8_experts(
    w: torch.Tensor,
    config: Fp8Config,
    group: dist.ProcessGroup | None = None,
    out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize stacked expert weights ``[E, N, K]`` to fp8 e4m3, one expert at a time.

    'tensor': scales ``[E]`` (each expert's absmax, MAX-reduced over ``group`` in one all-reduce);
    'block': scales ``[E, ceil(N/bn), ceil(K/bk)]`` (tiles never span two experts, no reduction).
    Expert ``e`` gets exactly the bytes :func:`~weight_sync.quant.fp8.quantize_fp8` gives ``w[e]``
    with that scale. Temporary memory is one expert in fp32. ``out`` = (qweight, scale) to write into,
    each used (and returned) only if it fits.
    """
    if w.dim() != 3:
        raise ConfigError(f"expert quantization needs stacked [E, N, K] weights, got shape {tuple(w.shape)}")
    e, n, k = w.shape
    qw = out[0] if fitting_output(out[0], w, (e, n, k), torch.float8_e4m3fn) else None
    q = qw if qw is not None else torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=w.device)
    if config.granularity == "tensor":
        scale = _scale(reduce_max(_absmax(w, (1, 2)).contiguous(), group))
        if fitting_output(out[1], w, (e,), torch.float32):
            assert out[1] is not None
            scale = out[1].copy_(scale)
        scratch = torch.empty((n, k), dtype=torch.float32, device=w.device)
        for i in range(e):
            # The per-tensor arithmetic of quantize_fp8: fp32 division, clamp, round-to-nearest cast. The
            # scale stays 1-D: a 0-dim fp32 scale would not promote a bf16 weight, dividing in bf16.
            torch.div(w[i], scale[i : i + 1], out=scratch)
            q[i].copy_(scratch.clamp_(-FP8_MAX, FP8_MAX))
        return q, scale
    bn, bk = config.block_size
    shape = (e, -(-n // bn), -(-k // bk))
    s_out = out[1] if fitting_output(out[1], w, shape, torch.float32) else None
    scales = s_out if s_out is not None else torch.empty(shape, dtype=torch.float32, device=w.device)
    for i in range(e):
        qi, si = quantize_fp8(w[i], config, None, out=(q[i], scales[i]))
        # quantize_fp8 writes into the views it was given when they fit (they always do here); copying
        # otherwise keeps this correct if that ever changes.
        if qi.data_ptr() != q[i].data_ptr():
            q[i].copy_(qi)
        if si.data_ptr() != scales[i].data_ptr():
            scales[i].copy_(si)
    return q, scales


def make_moe_method(spec: Any) -> FusedMoEMethod:
    """The experts method for a quantization spec (None, a short name or a config object)."""
    config = resolve_quantization(spec)
    if config is None:
        return UnquantizedFusedMoEMethod()
    if isinstance(config, Fp8Config):
        return Fp8FusedMoEMethod(config)
    raise ConfigError(
        f"fused MoE experts have no method for quantization {type(config).__name__} "
        f"({config!r}); supported: None, Fp8Config(granularity='tensor' | 'block')"
    )
