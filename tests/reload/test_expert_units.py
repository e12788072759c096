"""Expert-granular reload: a quantized experts layer completes and is processed one expert at a time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

import weight_sync.engine.moe as engine_moe
from weight_sync import IncompleteUpdateError, LayoutMismatchError, Manifest, begin_update
from weight_sync.engine import ReferenceEngine
from weight_sync.quant import Fp8Config, Fp8FusedMoEMethod
from weight_sync.reload import record_metadata_for_reloading, torn_reason
from weight_sync.reload.state import get_state
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal, make_checkpoint

EXPERTS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
# Wider experts than the tiny preset's, so that one expert (gate + up + down, bf16) outweighs every
# other processed layer: the peak in block order is then exactly one expert's staging.
WIDE = {"moe_intermediate_size": 128}


def _expert_bytes(hidden: int, inter: int) -> int:
    return (2 * inter * hidden + hidden * inter) * 2  # w13 [2I, H] + w2 [H, I] in bf16


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("units")
    return {
        "a": make_checkpoint(root / "a", arch="qwen3_moe", seed=0, tokenizer=False),
        "b": make_checkpoint(root / "b", arch="qwen3_moe", seed=1, tokenizer=False),
        "wide_a": make_checkpoint(root / "wa", arch="qwen3_moe", seed=0, tokenizer=False, **WIDE),
        "wide_b": make_checkpoint(root / "wb", arch="qwen3_moe", seed=1, tokenizer=False, **WIDE),
    }


@pytest.fixture
def units_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-tensor fp8 experts through the per-unit path: the method offers no bands (as with experts
    split over a TP group, whose scales are reduced expert by expert)."""
    monkeypatch.setattr(Fp8FusedMoEMethod, "row_bands", None)


@pytest.mark.parametrize("quant", [None, "fp8", "fp8-units", "fp8_block"])
def test_reload_processes_each_expert_when_its_keys_arrive_bitwise_equal_to_fresh(quant, ckpts, request) -> None:
    if quant == "fp8-units":
        request.getfixturevalue("units_only")
        quant = "fp8"
    elif quant == "fp8":
        # Per-tensor scales per expert: each expert's bands are quantized together once its rows are
        # all there, straight from the caller's tensors (reload/writes.py): no unit staging.
        engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization=quant)
        report = engine.reload_weights(ckpts["b"])
        assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(ckpts["b"], quantization=quant).model)
        assert set(EXPERTS) <= set(report.layers_banded) and report.units_processed == 0
        return
    engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization=quant)
    first = engine.last_report
    fresh = ReferenceEngine.from_checkpoint(ckpts["b"], quantization=quant)
    report = engine.reload_weights(ckpts["b"])
    assert_bitwise_equal(engine.model, fresh.model)
    if quant is None:  # bf16 experts take the direct path: nothing to process, nothing buffered
        assert report.layers_per_unit == () and set(EXPERTS) <= set(report.layers_direct)
        return
    # The first load makes the kernel tensors by processing whole layers; reloads go expert by expert.
    assert first.layers_per_unit == ()
    assert set(first.per_unit_fallbacks) == set(EXPERTS)
    assert "first load" in first.per_unit_fallbacks[EXPERTS[0]]
    assert report.layers_per_unit == EXPERTS and report.units_processed == 16
    assert set(EXPERTS) <= set(report.layers_processed) and report.per_unit_fallbacks == {}
    assert report.spilled_bytes == 0


@pytest.mark.parametrize("quant", ["fp8", "fp8-units", "fp8_block"])
def test_a_stream_in_block_order_buffers_at_most_one_experts_staging(quant, ckpts, request) -> None:
    units = quant == "fp8-units"
    if units:
        request.getfixturevalue("units_only")
        quant = "fp8"
    engine = ReferenceEngine.from_checkpoint(ckpts["wide_a"], quantization=quant)
    report = engine.reload_weights(ckpts["wide_b"])
    one = _expert_bytes(128, 128)
    if units:
        assert report.peak_buffered_bytes == one  # 98304 bytes; the whole experts layer is 8x that
    else:
        # Tile-aligned block experts are quantized key by key; a per-tensor expert holds copies of its
        # gate half until its up half arrives (a streamed checkpoint's tensors are copied at once).
        assert set(EXPERTS) <= set(report.layers_banded) and report.peak_buffered_bytes < one
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(ckpts["wide_b"], quantization=quant).model)
    # The tiny preset: one expert (49152 bytes) plus the non-expert layer in flight bound the peak.
    tiny = ReferenceEngine.from_checkpoint(ckpts["a"], quantization=quant)
    layers = {n: i.model_format_bytes for n, i in get_state(tiny.model).layers.items() if not i.direct}
    others = max(b for n, b in layers.items() if n not in EXPERTS)
    peak = tiny.reload_weights(ckpts["b"]).peak_buffered_bytes
    assert peak <= _expert_bytes(128, 64) + others and peak < layers[EXPERTS[0]]


def test_an_out_of_order_stream_keeps_experts_within_the_budget_and_spills_the_rest(ckpts, caplog,
                                                                                   units_only) -> None:
    engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization="fp8")
    items = list(iter_checkpoint(ckpts["b"]))
    random.Random(0).shuffle(items)
    budget = 3 * _expert_bytes(128, 64)
    with engine.begin_update(Manifest.from_named_tensors(items), budget_bytes=budget) as s:
        for name, tensor in items:
            s.load([(name, tensor)])
    report = s.report
    assert report is not None and report.layers_per_unit == EXPERTS
    assert report.peak_buffered_bytes <= budget and report.spilled_bytes > 0
    assert "out of layer order" in caplog.text and EXPERTS[0] in caplog.text
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(ckpts["b"], quantization="fp8").model)


class _LayerWideFp8(Fp8FusedMoEMethod):
    """An experts method whose processing needs all experts at once: it offers no per-expert hook."""

    process_units = None  # type: ignore[assignment]
    row_bands = None  # type: ignore[assignment]


def test_a_layer_wide_processor_falls_back_to_layer_completion_with_spill(ckpts, monkeypatch) -> None:
    monkeypatch.setattr(engine_moe, "make_moe_method", lambda spec: _LayerWideFp8(Fp8Config()))
    engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization="fp8")
    fresh = ReferenceEngine.from_checkpoint(ckpts["b"], quantization="fp8")
    layer_bytes = 8 * _expert_bytes(128, 64)
    report = engine.reload_weights(ckpts["b"])
    assert report.layers_per_unit == () and set(EXPERTS) <= set(report.layers_processed)
    assert report.peak_buffered_bytes == layer_bytes  # the whole experts layer waited for its last key
    assert_bitwise_equal(engine.model, fresh.model)
    # Under a budget smaller than the layer, its staging goes to host memory; bytes are unchanged.
    report = engine.reload_weights(ckpts["b"], budget_bytes=layer_bytes // 2)
    assert report.spilled_bytes >= 2 * layer_bytes and report.peak_buffered_bytes <= layer_bytes // 2
    assert_bitwise_equal(engine.model, fresh.model)


def _layer0_experts_first(path: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint with layer 0's expert keys first, expert by expert."""
    items = list(iter_checkpoint(path))
    first = sorted((i for i in items if i[0].startswith(EXPERTS[0] + ".")),
                   key=lambda i: int(i[0].split(".")[5]))
    return first + [i for i in items if not i[0].startswith(EXPERTS[0] + ".")]


@pytest.mark.parametrize("rollback", [True, False])
def test_a_failure_after_some_experts_rolls_back_bitwise_or_tears_the_experts_layer(rollback, ckpts) -> None:
    engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization="fp8")
    before = engine.fingerprint()
    items = _layer0_experts_first(ckpts["b"])
    manifest = Manifest.from_named_tensors(items)
    with pytest.raises(RuntimeError, match="trainer died"), engine.begin_update(manifest, rollback=rollback) as s:
        s.load(items[:3 * 4 + 1])  # experts 0..3 complete and processed, expert 4 half-arrived
        raise RuntimeError("trainer died")
    if rollback:
        assert engine.fingerprint() == before and torn_reason(engine.model) is None
    else:
        reason = torn_reason(engine.model)
        assert reason is not None and EXPERTS[0] in reason and "trainer died" in reason
        engine.reload_weights(ckpts["b"])
        assert torn_reason(engine.model) is None
        assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(ckpts["b"], quantization="fp8").model)


@pytest.mark.parametrize("path", ["units", "banded"])
def test_a_failure_before_any_expert_completes_tears_nothing(path, ckpts, request) -> None:
    if path == "units":
        request.getfixturevalue("units_only")
    engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization="fp8")
    before = engine.fingerprint()
    items = _layer0_experts_first(ckpts["b"])
    s = engine.begin_update(Manifest.from_named_tensors(items))
    if path == "units":
        s.load(items[:2])  # expert 0's first two keys: staged, never written into the live tensors
    else:
        # Expert 0's gate half: its w13 matrix waits for the up half, nothing is quantized yet.
        s.load([i for i in items if i[0] == f"{EXPERTS[0]}.0.gate_proj.weight"])
    s.abort("the trainer went away")
    assert torn_reason(engine.model) is None and engine.fingerprint() == before


def test_an_update_lacking_an_experts_key_is_refused_naming_it_and_rolled_back(ckpts) -> None:
    engine = ReferenceEngine.from_checkpoint(ckpts["a"], quantization="fp8")
    before = engine.fingerprint()
    gone = EXPERTS[0] + ".5.down_proj.weight"
    items = [i for i in iter_checkpoint(ckpts["b"]) if i[0] != gone]
    refused = pytest.raises(IncompleteUpdateError, match=rf"layer {EXPERTS[0]} needs processing .* missing {gone}")
    with refused, engine.begin_update(rollback=True, allow_partial=True) as s:
        s.load(items)
    assert engine.fingerprint() == before and torn_reason(engine.model) is None


class _Stacked(nn.Module):
    """A plain layer of four stacked units, processed as ``weight * 2``, unit by unit if ``by_unit``."""

    def __init__(self, replace: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 3, 8), requires_grad=False)
        self.replace = replace

    def ws_processor(self, mod: nn.Module) -> None:
        mod.weight = nn.Parameter(mod.weight.detach() * 2, requires_grad=False)

    def ws_process_units(self, mod, units, staging, targets) -> None:
        for j, u in enumerate(units):
            if self.replace:  # a wrong hook: makes a new kernel tensor instead of writing the live one
                mod.weight = nn.Parameter(targets["weight"].detach().clone(), requires_grad=False)
            targets["weight"].detach()[u].copy_(staging["weight"][j] * 2)


class _UnitModel(nn.Module):
    def __init__(self, replace: bool = False) -> None:
        super().__init__()
        self.experts = _Stacked(replace)

    def load_weights(self, weights) -> None:
        for name, t in weights:  # experts.<u>.weight -> unit u of the stacked weight
            self.experts.weight.data[int(name.split(".")[1])].copy_(t)


def _unit_items(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"experts.{u}.weight", torch.randn(3, 8, generator=g)) for u in range(4)]


def test_any_layer_declaring_a_unit_processor_reloads_unit_by_unit() -> None:
    model = _UnitModel()
    record_metadata_for_reloading(model)
    with begin_update(model) as s:
        s.load(_unit_items(0))
    assert s.report is not None and s.report.per_unit_fallbacks["experts"].startswith("first load")
    live = model.experts.weight
    with begin_update(model) as s:
        s.load(_unit_items(1))
    assert s.report is not None and s.report.layers_per_unit == ("experts",)
    assert s.report.units_processed == 4 and s.report.peak_buffered_bytes == 3 * 8 * 4
    assert model.experts.weight is live
    assert torch.equal(live, torch.stack([t for _, t in _unit_items(1)]) * 2)


def test_a_unit_processor_that_replaces_the_kernel_tensor_is_refused_and_rolled_back() -> None:
    model = _UnitModel(replace=True)
    record_metadata_for_reloading(model)
    with begin_update(model) as s:
        s.load(_unit_items(0))
    live, before = model.experts.weight, model.experts.weight.clone()
    refused = pytest.raises(LayoutMismatchError,
                            match=r"experts\.weight: per-unit processing must write into the live kernel "
                                  r"tensor, found it replaced by another tensor")
    with refused, begin_update(model, rollback=True) as s:
        s.load(_unit_items(1))
    assert model.experts.weight is live and torch.equal(live, before)


def test_a_key_writing_across_units_takes_the_layer_path_and_says_why() -> None:
    model = nn.Module()
    model.experts = _Stacked()
    record_metadata_for_reloading(model)
    whole = [("experts.weight", torch.ones(4, 3, 8))]
    with begin_update(model) as s:
        s.load(whole)
    with begin_update(model) as s:
        s.load(whole)
    assert s.report is not None and s.report.layers_per_unit == ()
    assert s.report.per_unit_fallbacks == {
        "experts": "key experts.weight writes across the dim-0 slices of weight"
    }
    assert torch.equal(model.experts.weight, torch.full((4, 3, 8), 2.0))
