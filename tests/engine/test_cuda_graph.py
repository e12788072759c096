"""On CUDA, decode is captured once in a graph; replays give the tokens of eager decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync.engine import ReferenceEngine

PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24], [9]]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_per_channel", "fp8_block", "int8"])
def test_cuda_graph_decode_tokens_equal_eager_decode(quant, qwen3_a: Path) -> None:
    graphed = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda", quantization=quant)
    eager = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda", quantization=quant,
                                            use_cuda_graph=False)
    got = graphed.generate(PROMPTS, 12)
    assert graphed.num_graph_replays == 11 and eager.num_graph_replays == 0
    assert got == eager.generate(PROMPTS, 12)
    assert graphed.generate(PROMPTS, 12) == got  # the same graph serves the next request


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_engine_logits_in_fp32(qwen3_a: Path) -> None:
    gpu = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda", dtype=torch.float32)
    cpu = ReferenceEngine.from_checkpoint(qwen3_a, dtype=torch.float32)
    torch.testing.assert_close(gpu.logits([[5, 6, 7, 8]]).cpu(), cpu.logits([[5, 6, 7, 8]]),
                               rtol=1e-3, atol=1e-3)
