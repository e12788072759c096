"""Online quantization: scales are right, round trips are close, the registry names what it knows."""

from __future__ import annotations

import pytest
import torch

from weight_sync.errors import ConfigError
from weight_sync.quant import (
    FP8_MAX,
    Fp8Config,
    Int8Config,
    dequantize_fp8,
    dequantize_int8,
    make_linear_method,
    quantize_fp8,
    quantize_int8,
    resolve_quantization,
)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_round_trip_error_is_within_e4m3_precision(granularity: str) -> None:
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    cfg = Fp8Config(granularity=granularity)
    q, scale = quantize_fp8(w, cfg)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    back = dequantize_fp8(q, scale, cfg, torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error per element <= 2**-4 (plus subnormal floor).
    assert ((back - w).abs() <= w.abs() / 16 + scale.max() * 2**-9).all()


def test_fp8_block_scales_are_the_amax_of_each_128_by_128_tile() -> None:
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(1))
    _, scale = quantize_fp8(w, Fp8Config(granularity="block"))
    assert scale.shape == (3, 2)
    for i in range(3):
        for j in range(2):
            tile = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scale[i, j] == tile.abs().max() / FP8_MAX


def test_fp8_channel_scales_are_per_output_row_and_tensor_scale_is_global() -> None:
    w = torch.randn(64, 32)
    _, per_row = quantize_fp8(w, Fp8Config(granularity="channel"))
    _, per_tensor = quantize_fp8(w, Fp8Config(granularity="tensor"))
    torch.testing.assert_close(per_row, w.abs().amax(1) / FP8_MAX)
    torch.testing.assert_close(per_tensor, w.abs().amax().reshape(1) / FP8_MAX)


def test_int8_round_trip_error_is_half_a_step() -> None:
    w = torch.randn(64, 48)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8
    assert ((dequantize_int8(q, scale, torch.float32) - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_quantization_is_deterministic_so_fresh_and_reloaded_bytes_agree() -> None:
    w = torch.randn(256, 256, dtype=torch.bfloat16)
    for cfg in (Fp8Config(granularity="tensor"), Fp8Config(granularity="block")):
        a, b = quantize_fp8(w, cfg), quantize_fp8(w.clone(), cfg)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def test_registry_resolves_short_names_and_rejects_unknown_ones() -> None:
    assert resolve_quantization("fp8_block") == Fp8Config(granularity="block")
    assert resolve_quantization("int8") == Int8Config()
    assert resolve_quantization(None) is None
    assert make_linear_method("fp8").requires_processing
    assert not make_linear_method(None).requires_processing
    with pytest.raises(ConfigError, match=r"unknown quantization 'fp4'.*fp8_block"):
        resolve_quantization("fp4")
    with pytest.raises(ConfigError, match="no registered linear method"):
        resolve_quantization(object())
    with pytest.raises(ConfigError, match="granularity"):
        Fp8Config(granularity="row")  # type: ignore[arg-type]
