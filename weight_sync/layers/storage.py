"""Re-pointing a tensor's storage without replacing the tensor object.

Parameters are referenced by optimizers, hooks and closures; offload swaps where a parameter's bytes live
(host storage, a device slot) while keeping the ``nn.Parameter`` object. Views keep the original strides:
kernels that use transposed weights (fp8 GEMMs) must see the same layout from any storage.
"""

from __future__ import annotations

import torch

__all__ = [
    "repoint",
    "strided_view",
]


def strided_view(
    base: torch.Tensor,
    *,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    dtype: torch.dtype,
    byte_offset: int,
) -> torch.Tensor:
    """A view of ``base``'s bytes at ``byte_offset`` with ``dtype``, ``shape`` and ``stride``.

    ``base`` is a flat byte (uint8) tensor, e.g. a device slot or a mmap'd file. The offset must be a
    multiple of the element size so the view needs no copy.
    """
    if base.dtype != torch.uint8 or base.dim() != 1:
        raise ValueError(f"base must be a 1-D uint8 tensor, got {tuple(base.shape)} {base.dtype}")
    elem = dtype.itemsize
    if byte_offset % elem:
        raise ValueError(f"byte_offset {byte_offset} is not a multiple of {dtype} element size {elem}")
    if any(d == 0 for d in shape):
        return torch.empty(shape, dtype=dtype, device=base.device)
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
    end = byte_offset + span * elem
    if end > base.numel():
        raise ValueError(f"view of {shape} {dtype} at byte {byte_offset} ends at {end}, past {base.numel()}")
    return base[byte_offset:end].view(dtype).as_strided(shape, stride)


def repoint(tensor: torch.Tensor, source: torch.Tensor) -> None:
    """Make ``tensor`` (a Parameter or buffer) use ``source``'s storage; the object stays the same."""
    if tuple(source.shape) != tuple(tensor.shape) or source.dtype != tensor.dtype:
        raise ValueError(
            f"cannot re-point a {tuple(tensor.shape)} {tensor.dtype} tensor onto "
            f"{tuple(source.shape)} {source.dtype} storage"
        )
    # .data assignment swaps the TensorImpl's storage under the same Python object, so references held
    # elsewhere (optimizers, hooks, closures) keep working and see the new bytes.
    tensor.data = source
