"""The two-pass fp8 dequantize (quant/fp8.py) gives the three-pass definition's weight bitwise (benchmarks/offload_dequant.py keeps that one for the side-by-side)."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import weight_sync.quant.fp8 as fp8
from weight_sync.offload import OffloadConfig, enable_layerwise_offload
from weight_sync.quant.fp8 import Fp8Config, quantize_fp8
from weight_sync.quant.modules import quantize_linears
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offload_dequant.py"


def _load() -> Any:
    if "offload_dequant" in sys.modules:
        return sys.modules["offload_dequant"]
    spec = importlib.util.spec_from_file_location("offload_dequant", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["offload_dequant"] = module
    spec.loader.exec_module(module)
    return module


def test_every_e4m3_value_is_exact_in_bf16_and_fp16() -> None:
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    exact = values.float()
    finite = ~exact.isnan()
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(values.to(dtype).float()[finite], exact[finite])


@pytest.mark.parametrize("granularity", ["block", "channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])  # whole tiles, ragged edge tiles
def test_the_two_pass_dequantize_equals_the_three_pass_definition_bitwise(
    granularity: str, dtype: torch.dtype, shape: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    # Spread over many binades, with exact zeros, so subnormal and clamped fp8 values occur.
    w = (torch.randn(shape) * torch.logspace(-6, 3, shape[1])).to(dtype)
    w[0, :7] = 0
    config = Fp8Config(granularity=granularity)  # type: ignore[arg-type]
    q, scale = quantize_fp8(w, config)
    expected = _load().dequantize_fp8_three_pass(q, scale, config, dtype)
    got = fp8.dequantize_fp8(q, scale, config, dtype)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), expected.view(torch.int16))


def test_use_dequant_swaps_the_dequantize_of_apply_and_puts_the_default_back() -> None:
    mod = _load()
    default = fp8.dequantize_fp8
    with mod.use_dequant("three_pass"):
        assert fp8.dequantize_fp8 is mod.dequantize_fp8_three_pass
    assert fp8.dequantize_fp8 is default


def test_an_fp8_streamed_offload_serves_the_same_output_under_either_dequantize() -> None:
    mod = _load()
    torch.manual_seed(0)
    base = SyntheticDiTPipeline(DiTConfig(hidden=128, num_blocks=2)).to(torch.bfloat16).eval()
    ref = copy.deepcopy(base)
    for block in ref.transformer.blocks:
        quantize_linears(block, "fp8_block")
    assert mod.mismatched_linears(ref, torch.bfloat16) == []
    expected = ref.generate(tokens=16, num_inference_steps=2, seed=3)
    config = OffloadConfig(enable_distributed_layerwise_offload=True, device="cpu", quantization="fp8_block")
    with enable_layerwise_offload(base, config), mod.use_dequant("three_pass"):
        out = base.generate(tokens=16, num_inference_steps=2, seed=3)
    assert torch.equal(out, expected)
