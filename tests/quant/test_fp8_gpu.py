"""The Triton fp8 kernels (CUDA) against the torch formulation they replace: the same bits."""

from __future__ import annotations

import pytest
import torch

from tests.quant._fp8_cases import (
    DTYPES,
    SPECIAL_CONFIGS,
    assert_same_bits,
    random_weight,
    special_weight,
    torch_path,
)
from tests.quant._fp8_cases import SHAPES as SMALL_SHAPES
from weight_sync.quant import fp8
from weight_sync.quant.fp8 import Fp8Config, quantize_fp8

SHAPES = [(256, 512), (300, 200), (1000, 4096), (129, 130), (7, 5), (4096, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("granularity,block", [("tensor", (128, 128)), ("channel", (128, 128)),
                                               ("block", (128, 128)), ("block", (16, 32))])
def test_the_triton_kernel_quantizes_bitwise_like_the_torch_path(dtype, granularity, block, monkeypatch) -> None:
    if not fp8.triton_available():
        pytest.skip("Triton is not importable here")
    config = Fp8Config(granularity=granularity, block_size=block)
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in SHAPES:
        w = (torch.randn(shape, device="cuda", generator=g) * 5).to(dtype)
        w[: shape[0] // 3] *= 1e-3  # rows (and tiles) with small scales, values far below e4m3's range
        w[0, 0] = 0.0
        fast_q, fast_s = quantize_fp8(w, config)
        with monkeypatch.context() as m:
            m.setattr(fp8, "triton_available", lambda: False)
            ref_q, ref_s = quantize_fp8(w, config)
        assert torch.equal(fast_s, ref_s)
        assert torch.equal(fast_q.view(torch.uint8), ref_q.view(torch.uint8)), (shape, dtype, granularity, block)


@pytest.mark.multi_gpu
def test_the_triton_kernel_quantizes_a_weight_on_a_gpu_that_is_not_the_current_one() -> None:
    # The nccl demo builds its reference engine on cuda:1 from a process whose current device is cuda:0.
    if torch.cuda.device_count() < 2 or not fp8.triton_available():
        pytest.skip("needs 2 GPUs and Triton")
    torch.cuda.set_device(0)
    w = torch.randn(256, 384, device="cuda:1").to(torch.bfloat16)
    config = Fp8Config(granularity="block")
    q, s = quantize_fp8(w, config)
    ref_q, ref_s = quantize_fp8(w.to("cuda:0"), config)
    assert q.device == torch.device("cuda:1")
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8).cpu()) and torch.equal(s.cpu(), ref_s.cpu())


def _fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record each call of the fused kernel through ``quantize_fp8`` (so a test knows it ran)."""
    calls: list[str] = []
    fused = fp8.quantize_fp8_fused

    def spy(w, granularity, *args, **kwargs):
        calls.append(granularity)
        return fused(w, granularity, *args, **kwargs)

    monkeypatch.setattr(fp8, "quantize_fp8_fused", spy)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity,block", SPECIAL_CONFIGS)
def test_the_fused_kernel_matches_the_torch_path_on_cuda_and_on_cpu(dtype, granularity, block, monkeypatch) -> None:
    # The torch path on CUDA and on CPU must agree too: scales divide by 448 on both (not CUDA's
    # multiply by a rounded 1/448), which is what the interpreter test checks the kernel against.
    if not fp8.triton_available():
        pytest.skip("Triton is not importable here")
    config = Fp8Config(granularity=granularity, block_size=block)
    calls = _fused_calls(monkeypatch)
    weights = [random_weight(shape, dtype, seed, "cuda") for seed, shape in enumerate(SMALL_SHAPES)]
    weights += [special_weight((200, 300), dtype, 7, "cuda"), special_weight((300, 520), dtype, 8, "cuda")]
    weights += [special_weight((200, 700), dtype, 9, "cuda")[:, 100:400]]  # row stride != width
    for i, w in enumerate(weights):
        q, s = quantize_fp8(w, config)
        assert_same_bits(q, s, *torch_path(w, config), (i, "cuda torch path"))
        assert_same_bits(q, s, *torch_path(w.cpu(), config), (i, "cpu torch path"))
    assert calls == [granularity] * len(weights)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (24576, 4096), (4096, 12288), (200, 20000)])
@pytest.mark.parametrize("granularity", ["block", "channel"])
def test_the_fused_kernel_matches_the_torch_path_on_qwen_sized_weights(shape, granularity, monkeypatch) -> None:
    # (200, 20000) channel rows are longer than one 128x128 tile: the kernel's two-pass column loop.
    if not fp8.triton_available():
        pytest.skip("Triton is not importable here")
    config = Fp8Config(granularity=granularity)
    calls = _fused_calls(monkeypatch)
    for w in (random_weight(shape, torch.bfloat16, 0, "cuda"), special_weight(shape, torch.bfloat16, 1, "cuda")):
        q, s = quantize_fp8(w, config)
        assert_same_bits(q, s, *torch_path(w, config), (shape, granularity))
    assert calls == [granularity] * 2


@pytest.mark.gpu
def test_the_tensor_granularity_keeps_the_cast_kernel_and_agrees_across_devices() -> None:
    if not fp8.triton_available():
        pytest.skip("Triton is not importable here")
    config = Fp8Config(granularity="tensor")
    for dtype in DTYPES:
        w_cpu = special_weight((200, 300), dtype, 3)
        q, s = quantize_fp8(w_cpu.cuda(), config)
        assert_same_bits(q, s, *torch_path(w_cpu.cuda(), config), dtype)
        assert_same_bits(q, s, *torch_path(w_cpu, config), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_quantizing_into_given_outputs_on_cuda_writes_them_bitwise_like_new_ones(granularity: str) -> None:
    w = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    cfg = fp8.Fp8Config(granularity=granularity)
    q_ref, s_ref = fp8.quantize_fp8(w, cfg)
    q_out, s_out = torch.empty_like(q_ref), torch.empty_like(s_ref)
    q, s = fp8.quantize_fp8(w, cfg, out=(q_out, s_out))
    assert q is q_out and s is s_out
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s.view(torch.int32), s_ref.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("granularity,block", [("tensor", (128, 128)), ("channel", (128, 128)),
                                               ("block", (128, 128)), ("block", (100, 50))])
def test_the_triton_dequantize_gives_the_torch_paths_weight_bitwise(dtype, granularity, block, monkeypatch) -> None:
    if not fp8.triton_available():
        pytest.skip("Triton is not importable here")
    config = Fp8Config(granularity=granularity, block_size=block)
    for i, shape in enumerate(SHAPES):
        q, s = quantize_fp8(random_weight(shape, torch.float32, i, "cuda"), config)
        half = max(1, shape[1] // 2)
        # Contiguous, and a column prefix: a view whose row stride is wider than its rows.
        for qq, ss in ((q, s), (q[:, :half], s[:, : -(-half // block[1])] if granularity == "block" else s)):
            fast = fp8.dequantize_fp8(qq, ss, config, dtype)
            with monkeypatch.context() as m:
                m.setattr(fp8, "triton_available", lambda: False)
                ref = fp8.dequantize_fp8(qq, ss, config, dtype)
            assert fast.dtype == ref.dtype == dtype
            bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
            assert torch.equal(fast.view(bits), ref.view(bits)), (shape, tuple(qq.shape), dtype, granularity, block)
