"""Reloading checkpoint B into an engine loaded with A gives exactly a fresh engine on B."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from weight_sync import begin_update
from weight_sync.engine import ReferenceEngine
from weight_sync.layers import signatures
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal

QUANTS = [None, "fp8", "fp8_per_channel", "fp8_block", "int8"]
PROMPTS = [[5, 6, 7], [20, 21, 22, 23]]


def _tensors(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(iter_checkpoint(path))


@pytest.mark.parametrize("quant", QUANTS)
def test_reload_b_into_a_equals_fresh_b_bitwise(quant, qwen3_a: Path, qwen3_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    fresh_b = ReferenceEngine.from_checkpoint(qwen3_b, quantization=quant)
    engine.reload_weights(qwen3_b)
    assert_bitwise_equal(engine.model, fresh_b.model)
    assert engine.generate(PROMPTS, 6) == fresh_b.generate(PROMPTS, 6)
    assert engine.fingerprint() == fresh_b.fingerprint()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_to_b_to_a_restores_bitwise(dtype, qwen3_a: Path, qwen3_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, dtype=dtype)
    fresh_a = ReferenceEngine.from_checkpoint(qwen3_a, dtype=dtype)
    engine.reload_weights(qwen3_b)
    engine.reload_weights(qwen3_a)
    assert_bitwise_equal(engine.model, fresh_a.model)


def test_a_to_b_to_a_restores_fp8_block_bytes_and_scales(qwen3_a: Path, qwen3_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8_block")
    fresh_a = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8_block")
    engine.reload_weights(qwen3_b)
    engine.reload_weights(qwen3_a)
    assert_bitwise_equal(engine.model, fresh_a.model)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32


def test_tied_llama_reload_equals_fresh(llama_tied: Path, llama_tied_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(llama_tied, quantization="fp8")
    engine.reload_weights(llama_tied_b)
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(llama_tied_b, quantization="fp8").model)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_every_kernel_tensor_keeps_its_data_ptr_over_three_updates(quant, qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    before = signatures(engine.model)
    for path in (qwen3_b, qwen3_a, qwen3_b):
        engine.reload_weights(path)
        assert signatures(engine.model) == before


def test_report_records_direct_and_processed_layers_and_replays_the_plan(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    report = engine.reload_weights(qwen3_b, version=7)
    assert report.version == 7
    assert "model.layers.0.self_attn.qkv_proj" in report.layers_processed
    assert "model.layers.1.mlp.down_proj" in report.layers_processed
    assert "model.layers.0.input_layernorm" in report.layers_direct
    assert "model.embed_tokens" in report.layers_direct
    assert report.keys_replayed == report.num_tensors and report.keys_via_loader == 0
    assert report.num_bytes == sum(t.numel() * t.element_size() for _, t in _tensors(qwen3_b))
    assert set(report.seconds) >= {"plan", "load", "process", "copy_back", "verify", "total"}
    assert report.fingerprint == engine.fingerprint()


@pytest.mark.parametrize("order", ["reversed", "interleaved", "shuffled"])
def test_out_of_order_streams_give_the_same_bytes_within_the_budget(order, qwen3_a, qwen3_b, caplog,
                                                                   staged_fp8) -> None:
    fresh_b = ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8")
    items = _tensors(qwen3_b)
    if order == "reversed":
        items = items[::-1]
    elif order == "interleaved":
        items = items[0::2] + items[1::2]
    else:
        random.Random(0).shuffle(items)
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    budget = 200_000
    with caplog.at_level("WARNING", logger="weight_sync.reload.session"):
        report = engine.reload_weights(weights_iterator=iter(items), budget_bytes=budget)
    assert_bitwise_equal(engine.model, fresh_b.model)
    assert report.peak_buffered_bytes <= budget
    warnings = [r.getMessage() for r in caplog.records if "out of layer order" in r.getMessage()]
    assert len(warnings) == 1, "warn once per update"
    assert "bytes" in warnings[0] and "model.layers." in warnings[0]


def test_a_budget_smaller_than_pending_layers_spills_to_host_and_stays_exact(qwen3_a, qwen3_b, staged_fp8) -> None:
    # Staged whole (bands would quantize each matrix when its rows are in, holding far less).
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    report = engine.reload_weights(weights_iterator=iter(_tensors(qwen3_b)[::-1]), budget_bytes=70_000)
    assert report.spilled_bytes > 0
    assert report.peak_buffered_bytes <= 70_000
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8").model)


def test_per_tensor_layers_out_of_order_hold_only_their_waiting_bands_within_the_budget(qwen3_a, qwen3_b,
                                                                                        caplog) -> None:
    fresh_b = ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8")
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    items = _tensors(qwen3_b)
    random.Random(1).shuffle(items)
    budget = 40_000  # less than one q band and the bands waiting with it: the rest goes to host memory
    with caplog.at_level("WARNING", logger="weight_sync.reload.session"), \
            engine.begin_update(budget_bytes=budget) as s:
        for name, t in items:
            s.load([(name, t.clone())])  # one key per call: a waiting band is copied as the call ends
    report = s.report
    assert report is not None and "model.layers.0.self_attn.qkv_proj" in report.layers_banded
    assert report.peak_buffered_bytes <= budget and report.spilled_bytes > 0
    warnings = [r.getMessage() for r in caplog.records if "out of layer order" in r.getMessage()]
    assert len(warnings) == 1 and "model.layers." in warnings[0]
    assert_bitwise_equal(engine.model, fresh_b.model)


def test_in_block_order_streams_buffer_at_most_one_layer(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    report = engine.reload_weights(qwen3_b)
    largest_layer = max(
        m.weight.numel() * 2 for m in engine.model.modules() if hasattr(m, "quant_method")
    )
    assert 0 < report.peak_buffered_bytes <= largest_layer


def test_mutating_sources_right_after_load_does_not_change_the_result(qwen3_a, qwen3_b) -> None:
    fresh_b = ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8")
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    session = engine.begin_update()
    scratch = None
    for name, t in _tensors(qwen3_b)[::-1]:
        buf = t.clone()
        session.load([(name, buf)])
        buf.fill_(123.0)  # the caller reuses its buffer immediately
        scratch = buf
    assert scratch is not None
    session.finish()
    assert_bitwise_equal(engine.model, fresh_b.model)


def test_the_session_context_manager_commits_on_success(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    with begin_update(engine.model, version="b") as session:
        session.load(_tensors(qwen3_b))
    assert session.status == "finished"
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b).model)


def test_reload_without_arguments_rereads_the_engines_own_checkpoint(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="int8")
    engine.reload_weights(weights_iterator=iter(_tensors(qwen3_b)))
    engine.reload_weights()
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_a, quantization="int8").model)


def test_float_to_float_casts_are_allowed(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, dtype=torch.float32)
    engine.reload_weights(weights_iterator=((n, t.float()) for n, t in _tensors(qwen3_b)))
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, dtype=torch.float32).model)
