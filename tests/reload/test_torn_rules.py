"""The lifecycle's promise after failures: when a model is torn, when it is servable again, what serves.

Regression tests for the holes of issue 13: a partial update never clears tears it did not rewrite and
never shrinks the reference layout; the seed's low-level names recover from a failed ``load_weights``;
serving calls refuse while an update is open; the buffering warning reports the bytes really held.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from weight_sync import (
    IncompleteUpdateError,
    LayoutMismatchError,
    Manifest,
    ManifestError,
    TornModelError,
    UpdateStateError,
    begin_update,
    finalize_layerwise_processing,
    initialize_layerwise_reload,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.reload import torn_reason
from weight_sync.reload.state import get_state
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.norm.weight"
LAYER1 = "model.layers.1."


def _items(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(iter_checkpoint(path))


def _tear(engine: ReferenceEngine, items, after: int) -> None:
    """Write ``after`` tensors of ``items`` and then fail the update (no rollback): the engine is torn."""

    def stream():
        yield from items[:after]
        raise OSError("trainer died")

    with pytest.raises(Exception, match="trainer died"):
        engine.reload_weights(weights_iterator=stream())
    assert torn_reason(engine.model) is not None


# ---------------------------------------------------------------- hole 1: partial updates and the torn flag
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_a_partial_update_of_other_layers_leaves_a_torn_model_torn(quant, qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    items_b = _items(qwen3_b)
    by_name = dict(items_b)
    # The failed update wrote the embedding and early layers; the partial one rewrites only the norm.
    _tear(engine, [(n, t) for n, t in items_b if n != NORM], after=len(items_b) // 2)
    subset = [(NORM, by_name[NORM])]
    report = engine.reload_weights(weights_iterator=iter(subset),
                                   manifest=Manifest.from_named_tensors(subset), allow_partial=True)
    assert report.partial
    assert torn_reason(engine.model) is not None
    with pytest.raises(TornModelError, match="trainer died"):
        engine.generate([[5, 6]], 2)


def test_a_partial_update_that_rewrites_every_torn_layer_makes_the_model_servable(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    items_b = _items(qwen3_b)
    layer1 = [(n, t) for n, t in items_b if n.startswith(LAYER1)]
    # A failed update that wrote only tensors of layer 1 ...
    _tear(engine, layer1, after=len(layer1) - 1)
    # ... is healed by a committed partial update that rewrites all of them.
    engine.reload_weights(weights_iterator=iter(layer1), manifest=Manifest.from_named_tensors(layer1),
                          allow_partial=True)
    assert torn_reason(engine.model) is None
    expected = ReferenceEngine.from_checkpoint(qwen3_a)
    expected.reload_weights(weights_iterator=iter(layer1), allow_partial=True)
    assert_bitwise_equal(engine.model, expected.model)


def test_a_partial_update_never_shrinks_what_later_updates_must_cover(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    items_b = _items(qwen3_b)
    subset = [(NORM, dict(items_b)[NORM])]
    report = engine.reload_weights(weights_iterator=iter(subset), manifest=Manifest.from_named_tensors(subset),
                                   allow_partial=True)
    assert report.partial
    # An update without a manifest still has to bring every tensor of the checkpoint ...
    with pytest.raises(IncompleteUpdateError, match="expected tensor"):
        engine.reload_weights(weights_iterator=iter(items_b[:-3]), rollback=True)
    # ... and a manifest that omits tensors still needs allow_partial.
    with pytest.raises(ManifestError, match="lacks"):
        engine.begin_update(Manifest.from_named_tensors(subset))
    engine.reload_weights(qwen3_b)
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8").model)


# ---------------------------------------------------------------- hole 2: the seed's low-level names
@pytest.mark.parametrize("rollback", [True, False])
def test_a_failed_load_weights_ends_the_layerwise_reload_and_the_next_one_works(rollback, qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    model = engine.model
    items_b = _items(qwen3_b)
    bad = [*items_b[:6], (Q_PROJ, torch.zeros(3, 3))]
    initialize_layerwise_reload(model, rollback=rollback)
    with pytest.raises(LayoutMismatchError, match=re.escape(Q_PROJ)):
        model.load_weights(bad)
    assert "load_weights" not in model.__dict__  # the routing shim is gone with its session
    with pytest.raises(UpdateStateError, match=r"was aborted.*LayoutMismatchError"):
        finalize_layerwise_processing(model)
    if rollback:
        assert_bitwise_equal(model, ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8").model)
    else:
        assert torn_reason(model) is not None
    initialize_layerwise_reload(model)
    model.load_weights(items_b)
    report = finalize_layerwise_processing(model, object())  # vLLM passes its model_config
    assert report.num_tensors == len(items_b)
    assert torn_reason(model) is None
    assert_bitwise_equal(model, ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8").model)


def test_finalize_names_no_update_when_none_was_opened(qwen3_a) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    with pytest.raises(UpdateStateError, match="no layerwise reload is in progress"):
        finalize_layerwise_processing(engine.model)


# ---------------------------------------------------------------- hole 3: serving while an update is open
def test_generate_and_logits_refuse_while_an_update_is_open(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    before = engine.generate([[5, 6]], 3)
    session = engine.begin_update(version="step-7")
    session.load(_items(qwen3_b)[:5])
    with pytest.raises(UpdateStateError, match=r"update 'step-7' is open"):
        engine.generate([[5, 6]], 3)
    with pytest.raises(UpdateStateError, match=r"update 'step-7' is open"):
        engine.logits([[5, 6]])
    session.abort()
    # Without rollback the written layers tear the model; the refusal then names the failure instead.
    with pytest.raises(TornModelError):
        engine.generate([[5, 6]], 3)
    engine.reload_weights(qwen3_a)
    assert engine.generate([[5, 6]], 3) == before


def test_a_worker_process_refuses_to_generate_while_its_update_is_open(qwen3_a) -> None:
    from trainers.rollout import RolloutWorker

    worker = RolloutWorker(qwen3_a)
    engine = worker.engine
    session = engine.begin_update(version=3)
    with pytest.raises(UpdateStateError, match="update 3 is open"):
        worker.collective_rpc("generate", ([[5, 6]], 2), {})
    session.abort()
    assert worker.collective_rpc("generate", ([[5, 6]], 2), {}) == engine.generate([[5, 6]], 2)


# ---------------------------------------------------------------- hole 4: the buffering warning
def test_out_of_order_buffering_is_reported_once_with_the_bytes_held_on_device_and_host(
    qwen3_a, qwen3_b, caplog, staged_fp8
) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    items = _items(qwen3_b)
    by_name = dict(items)
    keys = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in (0, 1) for p in "qkv"]
    keys += [f"model.layers.{i}.mlp.{p}_proj.weight" for i in (0, 1) for p in ("gate", "up")]
    first = [k for k in keys if k.endswith(("q_proj.weight", "gate_proj.weight"))]
    rest = [k for k in keys if k not in first]
    # Model-format bytes of the four pending layers, in the order they open.
    layers = get_state(engine.model).layers
    sizes = [layers[f"model.layers.{i}.{m}"].model_format_bytes
             for m, i in (("self_attn.qkv_proj", 0), ("self_attn.qkv_proj", 1),
                          ("mlp.gate_up_proj", 0), ("mlp.gate_up_proj", 1))]
    budget = sizes[0]  # room on the device for the first pending layer only
    caplog.set_level(logging.WARNING, logger="weight_sync.reload")
    with engine.begin_update(budget_bytes=budget) as s:
        s.load([(k, by_name[k]) for k in first])  # opens all four layers: 3 of them wait out of order
        s.load([(k, by_name[k]) for k in rest])
        s.load([(n, t) for n, t in items if n not in keys])
    warnings = [r.getMessage() for r in caplog.records if "out of layer order" in r.getMessage()]
    assert len(warnings) == 1, warnings
    msg = warnings[0]
    on_device, on_host = sizes[0], sum(sizes[1:])
    assert f"{on_device + on_host} bytes" in msg
    assert f"{on_device} bytes on the device" in msg
    assert f"{on_host} bytes in host memory" in msg
    assert f"budget {budget} bytes" in msg
    assert "model.layers.0.self_attn.qkv_proj" in msg and "model.layers.1.mlp.gate_up_proj" in msg
    assert s.report.peak_buffered_bytes == on_device
    assert s.report.spilled_bytes == on_host


def test_a_zero_budget_reports_everything_held_in_host_memory(qwen3_a, qwen3_b, caplog, staged_fp8) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    items = _items(qwen3_b)
    by_name = dict(items)
    q = [f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1)]
    layers = get_state(engine.model).layers
    held = sum(layers[f"model.layers.{i}.self_attn.qkv_proj"].model_format_bytes for i in (0, 1))
    caplog.set_level(logging.WARNING, logger="weight_sync.reload")
    with engine.begin_update(budget_bytes=0) as s:
        s.load([(k, by_name[k]) for k in q])
        s.load([(n, t) for n, t in items if n not in q])
    warnings = [r.getMessage() for r in caplog.records if "out of layer order" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"{held} bytes" in warnings[0] and "0 bytes on the device" in warnings[0]
    assert f"{held} bytes in host memory" in warnings[0]


def test_a_stream_in_layer_order_warns_about_nothing(qwen3_a, qwen3_b, caplog) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    caplog.set_level(logging.WARNING, logger="weight_sync.reload")
    engine.reload_weights(qwen3_b)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_begin_update_on_a_plain_module_keeps_the_promise_after_a_partial_update() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    full = [(n, torch.randn_like(p)) for n, p in model.named_parameters()]
    with begin_update(model) as s:
        s.load(full)

    def stream():
        yield full[0]
        raise OSError("trainer died")

    with pytest.raises(Exception, match="trainer died"), begin_update(model) as s:
        s.load(stream())
    # Rewriting another layer does not heal layer 0.
    with begin_update(model, Manifest.from_named_tensors(full[2:]), allow_partial=True) as s:
        s.load(full[2:])
    assert torn_reason(model) is not None
    with begin_update(model, Manifest.from_named_tensors(full[:2]), allow_partial=True) as s:
        s.load(full[:2])
    assert torn_reason(model) is None


# ---------------------------------------------------------------- the first update after a foreign load
def _foreign_loaded(path: Path) -> ReferenceEngine:
    """An engine whose weights another loader wrote (the model's own load_weights, as vLLM's loader)."""
    engine = ReferenceEngine.from_checkpoint(path, load_weights=False)
    engine.model.load_weights(iter_checkpoint(path))
    return engine


def test_the_first_update_after_a_foreign_load_is_held_to_the_declared_checkpoint(qwen3_a, qwen3_b) -> None:
    from weight_sync.reload import declare_loaded_layout, manifest_from_checkpoint

    engine = _foreign_loaded(qwen3_a)
    assert declare_loaded_layout(engine.model, manifest_from_checkpoint(qwen3_a)) == []
    layer1 = [(n, t) for n, t in _items(qwen3_b) if n.startswith(LAYER1)]
    # Only layer 1 of B: without the declared layout this was accepted and served a mix of A and B.
    with pytest.raises(IncompleteUpdateError, match="expected tensor"):
        engine.reload_weights(weights_iterator=iter(layer1), rollback=True)
    with pytest.raises(ManifestError, match="lacks"):
        engine.begin_update(Manifest.from_named_tensors(layer1))
    bigger = [(n, torch.zeros(t.shape[0] + 128, *t.shape[1:], dtype=t.dtype) if n == Q_PROJ else t)
              for n, t in _items(qwen3_b)]
    with pytest.raises(ManifestError, match=re.escape(Q_PROJ)):
        engine.begin_update(Manifest.from_named_tensors(bigger))
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_a).model)
    engine.reload_weights(qwen3_b)
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b).model)


def test_a_declared_layout_leaves_out_what_the_models_loaders_refuse(qwen3_a) -> None:
    from weight_sync.manifest import TensorMeta
    from weight_sync.reload import declare_loaded_layout, manifest_from_checkpoint

    engine = _foreign_loaded(qwen3_a)
    declared = manifest_from_checkpoint(qwen3_a)
    extra = Manifest((*declared.tensors, TensorMeta("model.layers.9.mlp.up_proj.weight", torch.bfloat16, (4, 4))))
    assert declare_loaded_layout(engine.model, extra) == ["model.layers.9.mlp.up_proj.weight"]
    engine.reload_weights(qwen3_a)  # the refused name is not required of updates
