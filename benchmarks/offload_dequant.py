"""The earlier three-pass fp8 dequantize, for ``bench_offload.py --dequant default three_pass``.

Where fp8-streamed blocks spend device time beyond the copy: ``Fp8LinearMethod.apply`` (``fp8_block``, and
``fp8`` / ``fp8_per_channel`` off the ``_scaled_mm`` path) dequantizes every linear on every forward with
``weight_sync.quant.fp8.dequantize_fp8``. It used to be ``q.float()``, a broadcast multiply by the scales,
``.to(bf16)``: three passes, about 15 bytes of device memory traffic per element (read 1 + write 4, read
4 + write 4, read 4 + write 2) and a 4-byte transient per element, ~1.7 GB per 227 MB bf16 block,
measured on the H200 as ~1 ms per block (resident fp8_block minus resident dense). ``dequantize_fp8`` now
gives the bitwise same weight in two passes (exact widening to bf16, one fp32 multiply rounded into
bf16; its docstring says why that is exact). This module keeps the three-pass formulation
(:func:`dequantize_fp8_three_pass`) so the benchmark can time both side by side, swapped in for both
sides of the comparison by :func:`use_dequant` and checked bitwise against the default on every weight
first (:func:`mismatched_linears`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

import weight_sync.quant.fp8 as fp8
from weight_sync.quant.fp8 import Fp8Config, _blocks, _unblock

__all__ = ["DEQUANT", "dequantize_fp8_three_pass", "mismatched_linears", "use_dequant"]

_DEFAULT = fp8.dequantize_fp8


def dequantize_fp8_three_pass(
    q: torch.Tensor, scale: torch.Tensor, config: Fp8Config, dtype: torch.dtype
) -> torch.Tensor:
    """The earlier formulation of ``weight_sync.quant.fp8.dequantize_fp8``: ``q.float()``, a multiply in
    fp32, ``.to(dtype)`` - three passes, ~15 bytes per element (the reference the side-by-side times)."""
    if config.granularity == "tensor":
        return (q.float() * scale).to(dtype)
    if config.granularity == "channel":
        return (q.float() * scale[:, None]).to(dtype)
    tiles = _blocks(q.float(), *config.block_size)
    return _unblock(tiles.mul_(scale[:, None, :, None]), (q.shape[0], q.shape[1])).to(dtype)


DEQUANT: dict[str, Callable[..., torch.Tensor]] = {"default": _DEFAULT, "three_pass": dequantize_fp8_three_pass}


@contextlib.contextmanager
def use_dequant(name: str) -> Iterator[None]:
    """Within the block, every ``Fp8LinearMethod.apply`` dequantizes with ``DEQUANT[name]``."""
    saved = fp8.dequantize_fp8
    fp8.dequantize_fp8 = DEQUANT[name]  # apply looks the module global up at each call
    try:
        yield
    finally:
        fp8.dequantize_fp8 = saved


def mismatched_linears(model: nn.Module, dtype: torch.dtype, name: str = "three_pass") -> list[str]:
    """Names of the fp8 linears of ``model`` whose ``DEQUANT[name]`` weight differs from the default's."""
    bad = []
    for mod_name, mod in model.named_modules():
        method = getattr(mod, "quant_method", None)
        if not isinstance(method, fp8.Fp8LinearMethod):
            continue
        q, s = mod.weight, mod.weight_scale
        ref, got = _DEFAULT(q, s, method.config, dtype), DEQUANT[name](q, s, method.config, dtype)
        if not torch.equal(ref.view(torch.int16), got.view(torch.int16)):
            bad.append(mod_name)
    return bad
