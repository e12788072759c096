"""On CUDA, MoE decode replays a captured graph (every expert on every token) and reloads bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.layers import signatures
from weight_sync.testing import assert_bitwise_equal, make_checkpoint

PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24], [9]]


@pytest.fixture(scope="module")
def moe_ab(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("moe_cuda")
    return tuple(  # type: ignore[return-value]
        make_checkpoint(root / n, arch="qwen3_moe", seed=s, tokenizer=False) for n, s in (("a", 0), ("b", 1))
    )


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_moe_cuda_graph_decode_tokens_equal_eager_decode(quant, moe_ab) -> None:
    a, _ = moe_ab
    # fp32: the graph's dense expert formulation rounds like the eager sparse one up to matmul row
    # blocking, far below what could change a greedy token.
    graphed = ReferenceEngine.from_checkpoint(a, device="cuda", quantization=quant, dtype=torch.float32)
    eager = ReferenceEngine.from_checkpoint(a, device="cuda", quantization=quant, dtype=torch.float32,
                                            use_cuda_graph=False)
    got = graphed.generate(PROMPTS, 10)
    assert graphed.num_graph_replays == 9
    assert got == eager.generate(PROMPTS, 10)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_moe_cuda_reload_equals_fresh_bitwise_and_keeps_the_graphs_pointers(quant, moe_ab) -> None:
    a, b = moe_ab
    engine = ReferenceEngine.from_checkpoint(a, device="cuda", quantization=quant)
    engine.generate(PROMPTS, 3)  # captures the decode graph
    before = signatures(engine.model)
    engine.reload_weights(b)
    fresh = ReferenceEngine.from_checkpoint(b, device="cuda", quantization=quant)
    assert signatures(engine.model) == before
    assert_bitwise_equal(engine.model, fresh.model)
    assert engine.generate(PROMPTS, 6) == fresh.generate(PROMPTS, 6)
