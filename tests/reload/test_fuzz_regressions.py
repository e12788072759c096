"""Holes the lifecycle fuzzer found, each pinned as a small deterministic sequence (see test_lifecycle_fuzz)."""

from __future__ import annotations

import pytest
import torch

from tests.reload._fuzz_world import assets, kernel_differences, snapshot_kernel
from weight_sync import (
    IncompleteUpdateError,
    LayoutMismatchError,
    Manifest,
    SourceError,
    TornModelError,
    UpdateStateError,
    finalize_layerwise_processing,
    initialize_layerwise_reload,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.reload import torn_reason

SIZE = {"max_batch_size": 1, "max_seq_len": 8}
NORM = "model.norm.weight"


def _engine(seed: int = 0, quant: str | None = None) -> ReferenceEngine:
    return ReferenceEngine.from_checkpoint(assets().paths[seed], quantization=quant, **SIZE)


def _items(seed: int) -> list[tuple[str, torch.Tensor]]:
    return list(assets().items[seed].items())


def _dies_after(items, k: int):
    yield from items[:k]
    raise OSError("trainer died")


# ------------------------------------------------------------------ hole 1
@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_partial_update_after_a_failed_one_does_not_clear_torn_while_written_layers_hold_its_bytes(
    with_manifest: bool,
) -> None:
    """Hole 1. Fuzzer: faulty_update(v3, caller_raises / missing, no rollback) then partial_update(v3,
    layers elsewhere) -> not torn, yet layers the failed update wrote hold v3 (MixedVersionsServed)."""
    engine = _engine(0)
    items = _items(1)
    with pytest.raises(SourceError):
        engine.reload_weights(weights_iterator=_dies_after(items, 10))  # writes the embedding and block 0
    assert torn_reason(engine.model) is not None
    subset = [(n, t) for n, t in _items(2) if n == NORM]  # a layer the failed update never wrote
    engine.reload_weights(weights_iterator=iter(subset), allow_partial=True,
                          manifest=Manifest.from_named_tensors(subset) if with_manifest else None)
    if torn_reason(engine.model) is None:  # servable: then it must hold one committed version
        expected = snapshot_kernel(ReferenceEngine.from_config(
            assets().cfg, weights=[(n, assets().items[2 if n == NORM else 0][n]) for n in assets().names],
            **SIZE).model)
        assert kernel_differences(engine.model, expected) == [], "serves bytes of the failed update"
    else:
        with pytest.raises(TornModelError):
            engine.generate([[5, 6]], 2)


def test_the_failed_updates_layers_rewritten_by_partial_updates_make_the_engine_servable_again() -> None:
    """Hole 1, the other half of the rule: torn ends once every written layer was rewritten."""
    engine = _engine(0)
    with pytest.raises(SourceError):
        engine.reload_weights(weights_iterator=_dies_after(_items(1), 3))
    written = {n for n, _ in _items(1)[:3]}
    engine.reload_weights(weights_iterator=iter([(n, t) for n, t in _items(2) if n in written]),
                          allow_partial=True)
    expected = [(n, assets().items[2 if n in written else 0][n]) for n in assets().names]
    fresh = ReferenceEngine.from_config(assets().cfg, weights=expected, **SIZE)
    assert torn_reason(engine.model) is None
    assert kernel_differences(engine.model, snapshot_kernel(fresh.model)) == []
    assert engine.generate([[5, 6]], 2) == fresh.generate([[5, 6]], 2)


def test_a_subset_manifest_does_not_shrink_what_later_full_updates_must_send() -> None:
    """Hole 1b. Fuzzer: partial_update(manifest of one layer) then begin/finish or the seed aliases with a
    missing tensor -> committed (BadUpdateAccepted), or an IncompleteUpdateError naming only the subset."""
    engine = _engine(0)
    subset = [(n, t) for n, t in _items(1) if n == NORM]
    engine.reload_weights(weights_iterator=iter(subset), manifest=Manifest.from_named_tensors(subset),
                          allow_partial=True)
    incomplete = [(n, t) for n, t in _items(2) if n != "lm_head.weight"]
    with pytest.raises(IncompleteUpdateError, match=r"lm_head\.weight"):
        engine.reload_weights(weights_iterator=iter(incomplete))


# ------------------------------------------------------------------ hole 2
def test_a_failing_load_weights_under_the_seed_aliases_ends_the_session_and_removes_the_shim() -> None:
    """Hole 2. Fuzzer: seed_alias_update with a shape / unknown / duplicate fault -> ShimLeft."""
    engine = _engine(0, "fp8")
    model = engine.model
    initialize_layerwise_reload(model)
    bad = [(n, torch.zeros(7, 128, dtype=torch.bfloat16) if n.endswith("k_proj.weight") else t)
           for n, t in _items(1)]
    with pytest.raises(LayoutMismatchError):
        model.load_weights(bad)
    assert "load_weights" not in model.__dict__, "the routing shim outlived its session"
    with pytest.raises(UpdateStateError, match="no layerwise reload"):
        finalize_layerwise_processing(model)
    initialize_layerwise_reload(model)
    model.load_weights(_items(2))
    finalize_layerwise_processing(model)
    assert kernel_differences(model, snapshot_kernel(_engine(2, "fp8").model)) == []


# ------------------------------------------------------------------ hole 3
@pytest.mark.parametrize("call", ["generate", "logits"])
def test_serving_calls_refuse_while_an_update_is_open(call: str) -> None:
    """Hole 3. Fuzzer: begin(v0) -> logits served (ServedDuringOpenUpdate)."""
    engine = _engine(0, "fp8")
    session = engine.begin_update(version="step-7")
    session.load(_items(1)[:6])
    serve = (lambda: engine.generate([[5, 6]], 2)) if call == "generate" else (lambda: engine.logits([[5]]))
    with pytest.raises(UpdateStateError, match="step-7"):
        serve()
    session.load(_items(1)[6:])
    session.finish()
    assert kernel_differences(engine.model, snapshot_kernel(_engine(1, "fp8").model)) == []
    serve()
