"""Online quantization as a per-layer processing step (first load and reload share it).

The layer is created in model format: a full-precision weight with the usual ``weight_loader``. Once all of
its checkpoint keys have arrived, :meth:`OnlineQuantLinearMethod.process_weights_after_loading` replaces it
with the quantized weight and its scales (kernel format). Reload copies the new kernel tensors into the
old ones, so the quantized bytes a captured graph reads change in place.

Per-tensor scales of TP-sharded layers are reduced (MAX) over the layer's TP group; every rank therefore
processes layers in the same order (reload completes layers by expected keys in stream order, which is
identical on all ranks of an engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weight_sync.quant.base import LinearMethod, layer_tensor

#: Module attribute under which reload offers a processed layer's live kernel tensors (name -> tensor) to
#: its processor, which may write its outputs straight into them (set only while the processor runs).
RELOAD_TARGETS = "ws_reload_targets"

__all__ = ["RELOAD_TARGETS", "OnlineQuantLinearMethod", "RowBands", "fitting_output", "split_over_group", "write_band"]


@dataclass(frozen=True, slots=True)
class RowBands:
    """How a method quantizes bands of rows of one model-format weight straight into the live kernel
    tensors, each band with exactly the bytes and scales processing the whole weight gives it.

    Offered only where every scale belongs to rows of one band (per-channel, 128x128 blocks): a band
    that starts at a multiple of ``align`` rows of its matrix and ends at one (or at the matrix's last
    row) then reads nothing outside itself. ``target(layer, matrix, row, rows)`` gives the live
    (qweight rows, scale rows) of rows ``row..row+rows`` of matrix ``matrix`` (0 for a 2-D weight; the
    expert for stacked ``[E, N, K]`` weights); ``quantize(items)`` quantizes each ``(src [rows, K],
    q, s)`` into its views, as many at once as it is given (equal ``quantize`` callables may be batched
    together). Used by reload (``weight_sync.reload.bands``) on reloads.

    ``matrix_rows`` > 0: one scale per matrix (per-tensor scales, per expert for stacked weights), so a
    band cannot be quantized alone. ``target`` then gives the matrix's one-element scale view, and
    ``quantize`` is only ever given every band of each matrix it sees (``matrix_rows`` rows in all,
    told apart by their scale view): it reduces their absmax first, then casts each band - the bytes of
    processing the matrix whole, without staging it.
    """

    align: int
    target: Callable[[nn.Module, int, int, int], tuple[torch.Tensor, torch.Tensor]]
    quantize: Callable[[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]], None]
    matrix_rows: int = 0
    # ``table(targets, shapes, dtype)``: ``quantize`` into fixed ``(q, s)`` targets made ready once (an
    # object whose ``launch(srcs, targets)`` quantizes and returns True, or False having done nothing),
    # or None where the method has no such path here. A replayed bucket list uses it at every update.
    table: Callable[..., Any] | None = None


def write_band(q: torch.Tensor, s: torch.Tensor, result: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy a band's (qweight, scale) ``result`` into the live views ``q`` / ``s`` unless it was
    computed in them."""
    if result[0].data_ptr() != q.data_ptr():
        q.copy_(result[0])
    if result[1].data_ptr() != s.data_ptr():
        s.copy_(result[1])


class OnlineQuantLinearMethod(LinearMethod):
    """Common part of the online methods: model-format weight in, (qweight, scale) out."""

    requires_processing = True
    # quantize() returns new tensors computed from the weight and drops it.
    processor_reads_input = True

    # Model format lives on meta until the first load materializes it layer by layer: a quantized
    # engine never holds a full-precision copy of the whole model.
    model_format_device = "meta"

    def quantize(
        self,
        weight: torch.Tensor,
        group: dist.ProcessGroup | None,
        out: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (quantized weight, scale) for a model-format weight.

        ``out``: tensors the results may be written into (returned as such) when their shape, dtype,
        device and contiguity fit; otherwise new tensors are returned.
        """
        raise NotImplementedError

    def row_bands(self, layer: nn.Module, name: str, shape: tuple[int, ...]) -> RowBands | None:
        """Band quantization of model-format tensor ``name`` (of ``shape``) into ``layer``'s live kernel
        tensors, or None where the method needs the whole tensor (e.g. one scale per tensor)."""
        return None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer_tensor(layer, "weight")
        if w.dtype in (torch.float8_e4m3fn, torch.int8):
            return  # already kernel format: processing twice would quantize quantized bytes
        # On a reload the live kernel tensors are offered: quantizing straight into them saves a
        # transient copy of the quantized weight and the copy back.
        targets = getattr(layer, RELOAD_TARGETS, None) or {}
        q, scale = self.quantize(w.detach(), getattr(layer, "tp_group", None),
                                 out=(targets.get("weight"), targets.get("weight_scale")))
        layer.weight = q if isinstance(q, nn.Parameter) else nn.Parameter(q, requires_grad=False)
        layer.weight_scale = scale if isinstance(scale, nn.Parameter) else nn.Parameter(scale, requires_grad=False)


def fitting_output(t: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether ``t`` can receive a result of ``shape`` and ``dtype`` computed from ``like`` (same device,
    contiguous, not overlapping ``like``)."""
    # Cheapest tests first: this runs a few times per quantized tensor of every reload.
    return (
        t is not None
        and t.dtype == dtype
        and t.shape == tuple(shape)
        and t.device == like.device
        and t.is_contiguous()
        and t.data_ptr() != like.data_ptr()
    )


def split_over_group(group: dist.ProcessGroup | None) -> bool:
    """Whether a layer with ``group`` is split over more than one rank (its per-tensor scales reduce)."""
    return group is not None and dist.get_world_size(group) > 1


def reduce_max(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce MAX over ``group`` (identity without a group or with one rank)."""
    if split_over_group(group):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t
