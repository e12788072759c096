"""A two-pass fp8 dequantize for ``bench_offload.py --dequant``: the same bf16 weight with half the traffic.

Where fp8-streamed blocks spend device time beyond the copy: ``Fp8LinearMethod.apply`` (``fp8_block``, and
``fp8`` / ``fp8_per_channel`` off the ``_scaled_mm`` path) dequantizes every linear on every forward with
``weight_sync.quant.fp8.dequantize_fp8``: ``q.float()``, a broadcast multiply by the scales, ``.to(bf16)``.
That is three passes over the weight, about 15 bytes of device memory traffic per element (read 1 + write
4, read 4 + write 4, read 4 + write 2) and a 4-byte transient per element: ~1.7 GB per 227 MB bf16 block,
measured on the H200 as ~1 ms per block (resident fp8_block minus resident dense).

:func:`dequantize_fp8_two_pass` gives the bitwise same result in two passes and ~7 bytes per element:
``q.to(bf16)`` is exact (every e4m3 value is representable in bf16 and fp16: 3 mantissa bits, exponents
-9..8), and ``torch.mul(wide, scale, out=bf16)`` still forms each product in fp32 (the scales are fp32,
so type promotion computes in fp32) and rounds it once to the output dtype, as ``.to(bf16)`` does. fp8
itself cannot enter type promotion ("Promotion for Float8 Types is not supported"), which is why the
exact widening comes first.

This belongs in ``weight_sync/quant/fp8.py`` (the resident baseline and the offload both compute through
it), which the offload does not own; here it is a benchmark variant, swapped in for both sides of the
comparison by :func:`use_dequant` and checked bitwise against the default on every weight first
(:func:`mismatched_linears`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

import weight_sync.quant.fp8 as fp8
from weight_sync.quant.fp8 import Fp8Config

__all__ = ["DEQUANT", "dequantize_fp8_two_pass", "mismatched_linears", "use_dequant"]

_DEFAULT = fp8.dequantize_fp8
_WIDE = (torch.bfloat16, torch.float16)  # dtypes that hold every e4m3 value exactly


def dequantize_fp8_two_pass(
    q: torch.Tensor, scale: torch.Tensor, config: Fp8Config, dtype: torch.dtype
) -> torch.Tensor:
    """``weight_sync.quant.fp8.dequantize_fp8`` in two passes (exact widening, one fused multiply-cast)."""
    n, k = q.shape
    bn, bk = config.block_size
    ragged = config.granularity == "block" and (n % bn or k % bk)
    if q.dtype != torch.float8_e4m3fn or dtype not in _WIDE or ragged:
        return _DEFAULT(q, scale, config, dtype)  # other dtypes, padded edge tiles: the default path
    wide = q.to(dtype)
    out = torch.empty((n, k), dtype=dtype, device=q.device)
    if config.granularity == "tensor":
        torch.mul(wide, scale, out=out)
    elif config.granularity == "channel":
        torch.mul(wide, scale[:, None], out=out)
    else:
        nb, kb = n // bn, k // bk
        torch.mul(wide.view(nb, bn, kb, bk), scale[:, None, :, None], out=out.view(nb, bn, kb, bk))
    return out


DEQUANT: dict[str, Callable[..., torch.Tensor]] = {"default": _DEFAULT, "two_pass": dequantize_fp8_two_pass}


@contextlib.contextmanager
def use_dequant(name: str) -> Iterator[None]:
    """Within the block, every ``Fp8LinearMethod.apply`` dequantizes with ``DEQUANT[name]``."""
    saved = fp8.dequantize_fp8
    fp8.dequantize_fp8 = DEQUANT[name]  # apply looks the module global up at each call
    try:
        yield
    finally:
        fp8.dequantize_fp8 = saved


def mismatched_linears(model: nn.Module, dtype: torch.dtype, name: str = "two_pass") -> list[str]:
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
