"""A processor offered the live kernel tensors on a reload writes its outputs straight into them: no
transient copy of the quantized weights, no copy back; a failure still rolls back or tears."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync import Manifest, begin_update
from weight_sync.engine import ReferenceEngine
from weight_sync.quant import Fp8Config, fp8, quantize_fp8
from weight_sync.reload import torn_reason
from weight_sync.testing import assert_bitwise_equal, hf_config, random_weights


def _fp8_engine(granularity: str) -> tuple[ReferenceEngine, dict]:
    cfg = hf_config("qwen3", "tiny")
    name = {"tensor": "fp8_per_tensor", "channel": "fp8_per_channel", "block": "fp8_block"}[granularity]
    return ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0), quantization=name), cfg


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_an_fp8_reload_quantizes_into_the_live_tensors_and_equals_a_fresh_load(granularity, monkeypatch) -> None:
    engine, cfg = _fp8_engine(granularity)
    # Whole kernel tensors, or (quantized key by key, reload/bands.py) views of their rows.
    live = {p.untyped_storage().data_ptr() for p in engine.model.parameters()}
    calls: list[bool] = []
    original = fp8.quantize_fp8

    def spy(w, config, group=None, out=(None, None)):
        q, s = original(w, config, group, out)
        # Written into the live kernel tensors that were offered, not into new ones.
        calls.append(q is out[0] and s is out[1] and q.untyped_storage().data_ptr() in live
                     and s.untyped_storage().data_ptr() in live)
        return q, s

    monkeypatch.setattr(fp8, "quantize_fp8", spy)
    weights = list(random_weights(cfg, seed=1))
    with begin_update(engine.model, Manifest.from_named_tensors(weights)) as s:
        s.load((n, t.clone()) for n, t in weights)
    if granularity == "tensor":
        # Per-tensor scales: each matrix's bands are quantized together, in the live rows (writes.py);
        # quantize_fp8 never runs on a staged whole.
        assert not calls and s.report is not None and s.report.layers_banded
        assert {p.untyped_storage().data_ptr() for p in engine.model.parameters()} == live
    else:
        assert calls and all(calls), calls
    twin, _ = _fp8_engine(granularity)
    with begin_update(twin.model, Manifest.from_named_tensors(weights)) as s2:
        s2.load(weights)
    assert_bitwise_equal(engine.model, twin.model)


def test_quantize_fp8_writes_into_fitting_outputs_and_allocates_for_others() -> None:
    w = torch.randn(256, 384, dtype=torch.bfloat16)
    cfg = Fp8Config(granularity="block")
    q_ref, s_ref = quantize_fp8(w, cfg)
    q_out, s_out = torch.empty_like(q_ref), torch.empty_like(s_ref)
    q, s = quantize_fp8(w, cfg, out=(q_out, s_out))
    assert q is q_out and s is s_out
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    wrong = torch.empty(10, dtype=torch.float8_e4m3fn)  # does not fit: a new tensor, nothing written
    q2, _ = quantize_fp8(w, cfg, out=(wrong, None))
    assert q2 is not wrong and torch.equal(q2.view(torch.uint8), q_ref.view(torch.uint8))


class _Writes(nn.Module):
    """Processed layer whose processor writes 2 * input into the offered live tensor, then may fail."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.fail = False

    def process_weights_after_loading(self) -> None:
        targets = getattr(self, "ws_reload_targets", None) or {}
        out = targets.get("weight")
        if out is not None:
            out.copy_(self.weight.detach() * 2)
            self.weight = out
        else:
            self.weight = nn.Parameter(self.weight.detach() * 2, requires_grad=False)
        if self.fail:
            raise RuntimeError("processing failed after writing its output")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Writes() for _ in range(2))

    def load_weights(self, weights) -> set[str]:
        for name, t in weights:
            self.get_parameter(name).data.copy_(t)
        return set()


def _processed_model() -> _Model:
    from weight_sync import record_metadata_for_reloading
    from weight_sync.reload import mark_layers_processed

    model = _Model()
    record_metadata_for_reloading(model)
    with torch.no_grad():
        model.load_weights([(f"layers.{i}.weight", torch.full((4, 4), float(i + 1))) for i in range(2)])
    for layer in model.layers:
        layer.process_weights_after_loading()
    mark_layers_processed(model)
    return model


@pytest.mark.parametrize("rollback", [True, False])
def test_a_processor_failing_after_writing_in_place_rolls_back_or_tears(rollback: bool) -> None:
    model = _processed_model()
    before = [layer.weight.detach().clone() for layer in model.layers]
    model.layers[0].fail = True  # the first layer processed: nothing else has been written yet
    weights = [(f"layers.{i}.weight", torch.full((4, 4), 10.0 + i)) for i in range(2)]
    with (
        pytest.raises(RuntimeError, match="after writing"),
        begin_update(model, Manifest.from_named_tensors(weights), rollback=rollback) as s,
    ):
        s.load(weights)
    if rollback:
        assert torn_reason(model) is None
        for layer, b in zip(model.layers, before):
            assert torch.equal(layer.weight, b)
    else:
        assert torn_reason(model) is not None  # never serves a mix silently
