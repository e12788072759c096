"""Bad input gets a specific error naming the tensor; the model is rolled back, untouched or torn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync import (
    DuplicateTensorError,
    IncompleteUpdateError,
    LayoutMismatchError,
    Manifest,
    ManifestError,
    SourceError,
    TensorMeta,
    TornModelError,
    UnknownTensorError,
    UpdateStateError,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal

K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def _items(path: Path) -> list[tuple[str, torch.Tensor]]:
    return list(iter_checkpoint(path))


def _with(items, name, tensor):
    return [(n, tensor if n == name else t) for n, t in items]


def _bad_streams(items):
    """(label, stream, expected exception, message pattern) for every kind of bad input."""
    return [
        ("unknown", [*items[:5], ("model.layers.7.mlp.up_proj.weight", items[5][1]), *items[5:]],
         UnknownTensorError, r"model\.layers\.7\.mlp\.up_proj\.weight"),
        ("duplicate", [*items[:8], items[3], *items[8:]], DuplicateTensorError,
         rf"{items[3][0]}.*twice"),
        ("shape", _with(items, K_PROJ, torch.zeros(7, 128, dtype=torch.bfloat16)),
         LayoutMismatchError, rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"),
        ("dtype", _with(items, K_PROJ, torch.zeros(64, 128, dtype=torch.int32)),
         LayoutMismatchError, rf"{K_PROJ}.*floating-point.*int32"),
    ]


def _fresh(path, quant):
    return ReferenceEngine.from_checkpoint(path, quantization=quant)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("case", range(4))
def test_bad_input_with_rollback_leaves_the_model_bitwise_unchanged(case, quant, qwen3_a, qwen3_b) -> None:
    engine, fresh_a = _fresh(qwen3_a, quant), _fresh(qwen3_a, quant)
    _, stream, exc, pattern = _bad_streams(_items(qwen3_b))[case]
    with pytest.raises(exc, match=pattern):
        engine.reload_weights(weights_iterator=iter(stream), rollback=True)
    assert_bitwise_equal(engine.model, fresh_a.model)
    assert engine.generate([[5, 6]], 3) == fresh_a.generate([[5, 6]], 3)


@pytest.mark.parametrize("case", range(4))
def test_bad_input_without_rollback_tears_the_model_until_a_good_update(case, qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, "fp8")
    _, stream, exc, pattern = _bad_streams(_items(qwen3_b))[case]
    with pytest.raises(exc, match=pattern):
        engine.reload_weights(weights_iterator=iter(stream))
    with pytest.raises(TornModelError, match="refuses to serve"):
        engine.generate([[5, 6]], 3)
    engine.reload_weights(qwen3_b)
    assert_bitwise_equal(engine.model, _fresh(qwen3_b, "fp8").model)
    assert engine.generate([[5, 6]], 3) == _fresh(qwen3_b, "fp8").generate([[5, 6]], 3)


@pytest.mark.parametrize("case", range(4))
def test_a_manifest_catches_bad_input_before_any_write(case, qwen3_a, qwen3_b) -> None:
    engine, fresh_a = _fresh(qwen3_a, "fp8"), _fresh(qwen3_a, "fp8")
    label, stream, _, _ = _bad_streams(_items(qwen3_b))[case]
    if label == "duplicate":
        with pytest.raises(ManifestError, match="twice"):
            Manifest.from_named_tensors(stream)
        return
    with pytest.raises(ManifestError, match="before any write"):
        engine.begin_update(Manifest.from_named_tensors(stream))
    assert_bitwise_equal(engine.model, fresh_a.model)
    assert engine.generate([[5, 6]], 3) == fresh_a.generate([[5, 6]], 3)


def test_manifest_problems_are_listed_by_name(qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, None)
    items = _with(_items(qwen3_b), K_PROJ, torch.zeros(7, 128, dtype=torch.bfloat16))
    items.append(("model.layers.0.mlp.nonsense.weight", torch.zeros(3)))
    with pytest.raises(ManifestError) as err:
        engine.begin_update(Manifest.from_named_tensors(items))
    assert K_PROJ in str(err.value) and "model.layers.0.mlp.nonsense.weight" in str(err.value)


def test_a_manifest_that_omits_expected_tensors_is_rejected_unless_partial(qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, None)
    items = [(n, t) for n, t in _items(qwen3_b) if n != "model.norm.weight"]
    with pytest.raises(ManifestError, match=r"lacks 1 tensor.*model\.norm\.weight"):
        engine.begin_update(Manifest.from_named_tensors(items))
    session = engine.begin_update(Manifest.from_named_tensors(items), allow_partial=True)
    session.load(items)
    report = session.finish()
    assert report.partial is True  # every announced tensor arrived, but not the model's whole layout
    assert torch.equal(engine.model.model.norm.weight, _fresh(qwen3_a, None).model.model.norm.weight)


def test_data_that_disagrees_with_the_manifest_is_refused(qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, None)
    items = _items(qwen3_b)
    session = engine.begin_update(Manifest.from_named_tensors(items), rollback=True)
    with pytest.raises(ManifestError, match=rf"{K_PROJ}: manifest announced \(64, 128\) bfloat16, got \(64, 128\) float32"):
        session.load(_with(items, K_PROJ, items[[n for n, _ in items].index(K_PROJ)][1].float()))
    assert session.status == "aborted"
    assert_bitwise_equal(engine.model, _fresh(qwen3_a, None).model)


@pytest.mark.parametrize("rollback", [True, False])
def test_missing_keys_at_finish_are_named(rollback, qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, "fp8")
    items = [(n, t) for n, t in _items(qwen3_b) if n not in ("model.norm.weight", K_PROJ)]
    with pytest.raises(IncompleteUpdateError, match=rf"2 expected tensor.*{K_PROJ}.*model\.norm\.weight") as err:
        engine.reload_weights(weights_iterator=iter(items), rollback=rollback)
    assert set(err.value.missing) == {K_PROJ, "model.norm.weight"}
    if rollback:
        assert_bitwise_equal(engine.model, _fresh(qwen3_a, "fp8").model)
    else:
        with pytest.raises(TornModelError):
            engine.generate([[5]], 2)


def test_allow_partial_accepts_missing_direct_tensors_but_not_half_a_quantized_layer(qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, "fp8")
    items = [(n, t) for n, t in _items(qwen3_b) if n != "model.norm.weight"]
    report = engine.reload_weights(weights_iterator=iter(items), allow_partial=True)
    assert report.partial
    assert torch.equal(engine.model.model.norm.weight, _fresh(qwen3_a, "fp8").model.model.norm.weight)
    items = [(n, t) for n, t in _items(qwen3_b) if n != K_PROJ]
    with pytest.raises(IncompleteUpdateError, match=r"qkv_proj needs processing.*k_proj"):
        engine.reload_weights(weights_iterator=iter(items), allow_partial=True, rollback=True)


@pytest.mark.parametrize("rollback", [True, False])
def test_an_iterator_failing_mid_stream_names_the_last_tensor(rollback, qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, "fp8")
    items = _items(qwen3_b)

    def stream():
        yield from items[:10]
        raise OSError("connection reset by trainer")

    with pytest.raises(SourceError, match=rf"after '{items[9][0]}'.*connection reset") as err:
        engine.reload_weights(weights_iterator=stream(), rollback=rollback)
    assert isinstance(err.value.__cause__, OSError)
    if rollback:
        assert_bitwise_equal(engine.model, _fresh(qwen3_a, "fp8").model)
    else:
        with pytest.raises(TornModelError):
            engine.logits([[5, 6]])
    engine.reload_weights(qwen3_b)
    assert_bitwise_equal(engine.model, _fresh(qwen3_b, "fp8").model)


def test_an_exception_inside_the_context_manager_aborts(qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, None)
    with pytest.raises(RuntimeError, match="trainer crashed"), engine.begin_update(rollback=True) as s:
        s.load(_items(qwen3_b)[:6])
        raise RuntimeError("trainer crashed")
    assert s.status == "aborted"
    assert_bitwise_equal(engine.model, _fresh(qwen3_a, None).model)


def test_lifecycle_calls_in_the_wrong_state_are_refused(qwen3_a, qwen3_b) -> None:
    engine = _fresh(qwen3_a, None)
    session = engine.begin_update()
    with pytest.raises(UpdateStateError, match="already in progress"):
        engine.begin_update()
    session.load(_items(qwen3_b))
    session.finish()
    with pytest.raises(UpdateStateError, match="already finished"):
        session.load(_items(qwen3_b)[:1])


def test_an_aborted_update_without_writes_leaves_the_model_servable(qwen3_a) -> None:
    engine = _fresh(qwen3_a, "fp8")
    session = engine.begin_update(Manifest([TensorMeta("model.norm.weight", torch.bfloat16, (128,))]),
                                  allow_partial=True)
    session.abort()
    assert engine.generate([[5, 6]], 2) == _fresh(qwen3_a, "fp8").generate([[5, 6]], 2)
