"""Reloads of per-channel, block- and per-tensor-scaled layers quantize each key's rows straight into the kernel tensors."""

from __future__ import annotations

import pytest
import torch

from weight_sync import (
    IncompleteUpdateError,
    Manifest,
    ManifestError,
    UpdateStateError,
    begin_update,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.reload import torn_reason
from weight_sync.reload.state import get_state
from weight_sync.testing import assert_bitwise_equal, hf_config, random_weights

# head_dim 64: q, k and v each start on a 128-row tile of qkv; the tiny preset's v (row 192) does not.
ALIGNED = {"head_dim": 64}
QUANTS = ["fp8_per_channel", "fp8_block", "int8"]


def _engine(quant: str, seed: int = 0, **overrides) -> tuple[ReferenceEngine, dict]:
    cfg = hf_config("qwen3", "tiny", **overrides)
    return ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=seed), quantization=quant), cfg


@pytest.mark.parametrize("quant", QUANTS)
def test_every_quantized_layer_is_written_key_by_key_without_staging_bitwise_like_a_fresh_load(quant) -> None:
    engine, cfg = _engine(quant, **ALIGNED)
    for seed in (1, 2, 1):  # later updates replay the cached band writers
        report = engine.reload_weights(weights_iterator=random_weights(cfg, seed=seed))
        assert set(report.layers_banded) == set(report.layers_processed) and len(report.layers_banded) == 8
        assert report.peak_buffered_bytes == 0 and report.spilled_bytes == 0
        assert_bitwise_equal(engine.model, _engine(quant, seed=seed, **ALIGNED)[0].model)


def test_a_fused_layer_whose_parts_straddle_a_tile_is_staged_and_processed_whole() -> None:
    engine, cfg = _engine("fp8_block")  # tiny: v starts at row 192 of qkv, inside the second tile
    report = engine.reload_weights(weights_iterator=random_weights(cfg, seed=1))
    qkv = [n for n in report.layers_processed if n.endswith("qkv_proj")]
    assert qkv and not set(qkv) & set(report.layers_banded)
    assert {n for n in report.layers_processed if n.endswith(("gate_up_proj", "down_proj", "o_proj"))} \
        <= set(report.layers_banded)
    assert report.peak_buffered_bytes > 0
    assert_bitwise_equal(engine.model, _engine("fp8_block", seed=1)[0].model)


@pytest.mark.parametrize("rollback", [True, False])
def test_a_failure_after_some_bands_were_written_rolls_back_or_tears(rollback: bool) -> None:
    engine, cfg = _engine("fp8_block", **ALIGNED)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    weights = list(random_weights(cfg, seed=1))
    cut = next(i for i, (n, _) in enumerate(weights) if "layers.1.self_attn.q_proj" in n)
    session = begin_update(engine.model, Manifest.from_named_tensors(weights), rollback=rollback)
    session.load(weights[:cut])  # every band of layer 0 is live already
    name, t = weights[cut]
    with pytest.raises(ManifestError, match=name.replace(".", r"\.")):
        session.load([(name, t[:1])])
    if rollback:
        after = engine.model.state_dict()
        assert all(torch.equal(after[k].view(torch.uint8) if after[k].dtype == torch.float8_e4m3fn else after[k],
                               v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
                   for k, v in before.items())
        assert torn_reason(engine.model) is None
    else:
        assert "layers.0" in (torn_reason(engine.model) or "")


def test_a_banded_layer_missing_a_key_fails_the_update_naming_the_key_even_when_partial_is_allowed() -> None:
    engine, cfg = _engine("fp8_per_channel", **ALIGNED)
    weights = [(n, t) for n, t in random_weights(cfg, seed=1) if n != "model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(IncompleteUpdateError, match=r"k_proj"), \
            begin_update(engine.model, allow_partial=True, rollback=True) as s:
        s.load(weights)
    assert torn_reason(engine.model) is None  # rolled back


def _bucketed_reload(engine: ReferenceEngine, weights: list, buckets: list[int], **options):
    """One update loading ``weights`` as list buckets ending at the ``buckets`` positions, from copies
    the caller overwrites as soon as each call returns (as a transport reuses its receive buffers)."""
    with begin_update(engine.model, Manifest.from_named_tensors(weights), **options) as s:
        start = 0
        for end in [*buckets, len(weights)]:
            bucket = [(n, t.clone()) for n, t in weights[start:end]]
            s.load(bucket)
            for _, t in bucket:
                t.fill_(7.0)
            start = end
    return s.report


@pytest.mark.parametrize("split", ["whole buckets", "a matrix across two calls"])
def test_per_tensor_layers_are_quantized_matrix_by_matrix_from_the_callers_buckets(split: str) -> None:
    engine, cfg = _engine("fp8_per_tensor")
    for seed in (1, 2, 1):
        weights = list(random_weights(cfg, seed=seed))
        # The cut falls between layer 0's q and k: its qkv matrix waits for k and v in the next call.
        cut = [next(i for i, (n, _) in enumerate(weights) if "layers.0.self_attn.k_proj" in n)]
        report = _bucketed_reload(engine, weights, cut if split != "whole buckets" else [])
        assert report is not None and set(report.layers_banded) == set(report.layers_processed)
        q_bytes = dict(weights)["model.layers.0.self_attn.q_proj.weight"].nbytes
        # Nothing is staged, except copies of the bands of a matrix still incomplete when a call ends.
        assert report.peak_buffered_bytes == (0 if split == "whole buckets" else q_bytes)
        assert_bitwise_equal(engine.model, _engine("fp8_per_tensor", seed=seed)[0].model)


@pytest.mark.parametrize("rollback", [True, False])
def test_a_per_tensor_update_failing_between_matrices_rolls_back_or_tears_only_written_layers(rollback) -> None:
    engine, cfg = _engine("fp8_per_tensor")
    before = engine.fingerprint()
    weights = list(random_weights(cfg, seed=1))
    cut = next(i for i, (n, _) in enumerate(weights) if "layers.1.self_attn.k_proj" in n)
    session = begin_update(engine.model, Manifest.from_named_tensors(weights), rollback=rollback)
    session.load(weights[:cut])  # layer 0 quantized into the live tensors; layer 1's qkv waits for k, v
    session.abort("the trainer went away")
    if rollback:
        assert engine.fingerprint() == before and torn_reason(engine.model) is None
    else:
        torn = get_state(engine.model).torn_layers
        assert "model.layers.0.self_attn.qkv_proj" in torn and "model.layers.1.self_attn.qkv_proj" not in torn


@pytest.mark.parametrize("quant", [*QUANTS, "fp8_per_tensor"])
def test_a_wider_wire_dtype_is_rounded_to_the_model_format_before_its_bands_are_quantized(quant) -> None:
    # An fp32 trainer's weights into a bf16 model: staging would round them to bf16 first, and a fresh
    # load does; quantizing the fp32 values straight from the caller's tensor gave other bytes.
    engine, cfg = _engine(quant, **ALIGNED)
    wide = [(n, t.float() * 1.001) for n, t in random_weights(cfg, seed=1)]
    report = _bucketed_reload(engine, wide, [])
    assert report is not None and report.layers_banded
    fresh = ReferenceEngine.from_config(cfg, weights=iter(wide), quantization=quant)
    assert_bitwise_equal(engine.model, fresh.model)


def test_a_per_tensor_matrix_still_missing_rows_at_finish_fails_instead_of_serving_its_old_bytes() -> None:
    engine, cfg = _engine("fp8_per_tensor")
    before = engine.fingerprint()
    weights = list(random_weights(cfg, seed=1))
    k = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(UpdateStateError, match=r"model\.layers\.0\.self_attn\.qkv_proj .*without load"), \
            begin_update(engine.model, Manifest.from_named_tensors(weights), rollback=True) as s:
        s.load([(n, t) for n, t in weights if n != k])
        s.mark_applied(k, dict(weights)[k].nbytes)  # counted as arrived, written some other way
    assert engine.fingerprint() == before and torn_reason(engine.model) is None
