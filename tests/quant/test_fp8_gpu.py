"""The Triton fp8 kernel (CUDA) against the torch formulation it replaces: the same bits."""

from __future__ import annotations

import pytest
import torch

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
