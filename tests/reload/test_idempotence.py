"""Reloading the same weights again changes nothing: same kernel bytes, same outputs, every quantization.

Non-idempotent post-processing (padding left uninitialized, scales derived from the previous scales, a
flag that skips processing on the second pass) is the field's most common silent failure, so each path
is reloaded three times and compared bitwise with a fresh load after every reload.
"""

from __future__ import annotations

import pytest
import torch

from weight_sync import begin_update, record_metadata_for_reloading
from weight_sync.engine import ReferenceEngine
from weight_sync.layers.tensors import signatures
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal

QUANTIZATIONS = [None, "fp8", "fp8_per_channel", "fp8_block", "int8"]
PROMPT = [[5, 6, 7]]


@pytest.mark.parametrize("quant", QUANTIZATIONS)
def test_reloading_the_same_checkpoint_three_times_keeps_every_kernel_byte(quant, qwen3_a, qwen3_b) -> None:
    fresh = ReferenceEngine.from_checkpoint(qwen3_b, quantization=quant)
    want_logits, want_tokens = fresh.logits(PROMPT), fresh.generate(PROMPT, 4)
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    pointers = signatures(engine.model)
    items = list(iter_checkpoint(qwen3_b))
    for attempt, how in enumerate(["path", "iterator", "session"]):
        if how == "path":
            engine.reload_weights(qwen3_b)
        elif how == "iterator":
            engine.reload_weights(weights_iterator=iter(items[::-1]))  # out of order, same bytes
        else:
            with engine.begin_update() as s:
                s.load(items)
        assert_bitwise_equal(engine.model, fresh.model)
        assert torch.equal(engine.logits(PROMPT), want_logits), f"logits differ after reload {attempt + 1}"
        assert engine.generate(PROMPT, 4) == want_tokens
        assert signatures(engine.model) == pointers


@pytest.mark.parametrize("quant", QUANTIZATIONS)
def test_reloading_an_engine_with_its_own_weights_is_a_bitwise_no_op(quant, qwen3_a) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    fresh = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    fingerprint = engine.fingerprint()
    for _ in range(3):
        report = engine.reload_weights()
        assert report.fingerprint == fingerprint
        assert_bitwise_equal(engine.model, fresh.model)


def test_a_plain_module_reloaded_three_times_holds_exactly_the_weights_sent() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    record_metadata_for_reloading(model)
    weights = [(n, torch.randn_like(p)) for n, p in model.named_parameters()]
    for _ in range(3):
        with begin_update(model) as s:
            s.load(weights)
        for name, tensor in weights:
            assert torch.equal(model.get_parameter(name), tensor), name
