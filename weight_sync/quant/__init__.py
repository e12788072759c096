"""Online quantization processors behind one registry: fp8 e4m3 (tensor, channel, 128x128 block), int8.

A quantization is a per-layer processing step run by the reload lifecycle when a layer's last expected
key arrives, on first load and reload alike. Register new schemes with :func:`register_linear_method`.
Fused MoE experts have their own methods (:mod:`weight_sync.quant.moe`: bf16, fp8 per expert).

Limitations: activations are not quantized on CPU (weights are dequantized for the matmul); block scales
always dequantize, also on CUDA.
"""

from weight_sync.quant.base import LinearMethod, UnquantizedLinearMethod, make_weight_param
from weight_sync.quant.fp8 import FP8_MAX, Fp8Config, Fp8LinearMethod, dequantize_fp8, quantize_fp8
from weight_sync.quant.int8 import Int8Config, Int8LinearMethod, dequantize_int8, quantize_int8
from weight_sync.quant.moe import (
    Fp8FusedMoEMethod,
    FusedMoEMethod,
    UnquantizedFusedMoEMethod,
    make_moe_method,
    quantize_fp8_experts,
)
from weight_sync.quant.registry import (
    QUANTIZATION_NAMES,
    make_linear_method,
    register_linear_method,
    resolve_quantization,
)

__all__ = [
    "FP8_MAX",
    "QUANTIZATION_NAMES",
    "Fp8Config",
    "Fp8FusedMoEMethod",
    "Fp8LinearMethod",
    "FusedMoEMethod",
    "Int8Config",
    "Int8LinearMethod",
    "LinearMethod",
    "UnquantizedFusedMoEMethod",
    "UnquantizedLinearMethod",
    "dequantize_fp8",
    "dequantize_int8",
    "make_linear_method",
    "make_moe_method",
    "make_weight_param",
    "quantize_fp8",
    "quantize_fp8_experts",
    "quantize_int8",
    "register_linear_method",
    "resolve_quantization",
]
