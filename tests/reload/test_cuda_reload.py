"""On CUDA: a captured decode graph replays with reloaded weights, and reload stays bitwise exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.layers import signatures
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal

PROMPTS = [[5, 6, 7], [20, 21, 22, 23]]


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_captured_graph_replays_the_new_weights(quant, qwen3_a: Path, qwen3_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda", quantization=quant)
    engine.generate(PROMPTS, 6)  # captures the decode graph with A's tensors
    graph = engine._graph
    assert graph is not None
    before = signatures(engine.model)
    engine.reload_weights(weights_iterator=((n, t.cuda()) for n, t in iter_checkpoint(qwen3_b)))
    assert signatures(engine.model) == before
    fresh_b = ReferenceEngine.from_checkpoint(qwen3_b, device="cuda", quantization=quant,
                                              use_cuda_graph=False)
    assert engine.generate(PROMPTS, 6) == fresh_b.generate(PROMPTS, 6)
    assert engine._graph is graph  # replayed, never recaptured
    assert_bitwise_equal(engine.model, fresh_b.model)


@pytest.mark.gpu
def test_out_of_order_reload_on_cuda_spills_to_pinned_host_memory_and_is_exact(qwen3_a, qwen3_b,
                                                                               staged_fp8) -> None:
    # staged_fp8: whole layers are staged (per-tensor bands hold one matrix's rows at most, far below any budget)
    engine = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda", quantization="fp8")
    items = [(n, t.cuda()) for n, t in iter_checkpoint(qwen3_b)][::-1]
    report = engine.reload_weights(weights_iterator=iter(items), budget_bytes=70_000)
    assert report.spilled_bytes > 0 and report.peak_buffered_bytes <= 70_000
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, device="cuda",
                                                                       quantization="fp8").model)
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["fp8_per_channel", "fp8_block", "int8"])
def test_band_quantized_layers_on_cuda_are_written_in_grouped_launches_bitwise_like_a_fresh_load(quant) -> None:
    from weight_sync.testing import hf_config, random_weights

    cfg = hf_config("qwen3", "tiny", head_dim=64)  # q, k, v each start on a 128-row tile
    engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device="cuda"), device="cuda",
                                         quantization=quant)
    engine.generate(PROMPTS, 4)
    graph = engine._graph
    for seed in (1, 2):
        items = list(random_weights(cfg, seed=seed, device="cuda"))
        report = engine.reload_weights(weights_iterator=iter(items))
        assert set(report.layers_banded) == set(report.layers_processed) and report.peak_buffered_bytes == 0
        fresh = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=seed, device="cuda"),
                                            device="cuda", quantization=quant, use_cuda_graph=False)
        assert_bitwise_equal(engine.model, fresh.model)
        assert engine.generate(PROMPTS, 4) == fresh.generate(PROMPTS, 4)
        assert engine._graph is graph


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_per_tensor_matrices_on_cuda_are_quantized_in_two_grouped_launches_bitwise_like_a_fresh_load(arch) -> None:
    from weight_sync import Manifest, begin_update
    from weight_sync.testing import hf_config, random_weights

    cfg = hf_config(arch, "tiny")
    engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device="cuda"), device="cuda",
                                         quantization="fp8_per_tensor", use_cuda_graph=False)
    for seed in (1, 2):
        items = list(random_weights(cfg, seed=seed, device="cuda"))
        half = len(items) // 2  # one matrix likely straddles the two buckets: its first bands are copied
        with begin_update(engine.model, Manifest.from_named_tensors(items)) as s:
            s.load(items[:half])
            s.load(items[half:])
        assert s.report is not None and set(s.report.layers_banded) == set(s.report.layers_processed)
        fresh = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=seed, device="cuda"),
                                            device="cuda", quantization="fp8_per_tensor", use_cuda_graph=False)
        assert_bitwise_equal(engine.model, fresh.model)
    torch.cuda.synchronize()
