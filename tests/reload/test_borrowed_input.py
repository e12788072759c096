"""Processors that only read their input process a whole, single-key tensor where it lies (no staging copy)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync import Manifest, begin_update, record_metadata_for_reloading, reload_weights
from weight_sync.reload import mark_layers_processed
from weight_sync.reload.state import get_state


class Packing(nn.Module):
    """Processing packs a copy of the weight and empties the parameter (as vLLM-CPU's oneDNN path does);
    with ``keep`` it also holds on to its input, which a declared read-only processor must not do."""

    def __init__(self, rows: int = 8, *, keep: bool = False, reads_input: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, 4), requires_grad=False)
        self.keep = keep
        self.ws_processor_reads_input = reads_input

    def process_weights_after_loading(self) -> None:
        self.input_ptr = self.weight.data_ptr()
        self.packed = [self.weight.detach().t().contiguous()]  # not a graph-visible tensor
        if self.keep:
            self.kept = [self.weight.detach()]
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class Fused(nn.Module):
    """A processed layer fed by two keys (``a`` and ``b`` halves of one weight): never borrowed."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.weight.weight_loader = self.load
        self.ws_processor_reads_input = True

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        param.data[(0 if shard == "a" else 4) : (4 if shard == "a" else 8)].copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.input_ptr = self.weight.data_ptr()
        self.packed = [self.weight.detach().clone()]


class Model(nn.Module):
    def __init__(self, keeps: tuple[bool, ...] = (False, False)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Packing(keep=k) for k in keeps)
        self.fused = Fused()
        self.plain = Packing(reads_input=False)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        for name, t in weights:
            if name.startswith("fused."):
                self.fused.weight.weight_loader(self.fused.weight, t, name.removeprefix("fused."))
            else:
                params[name].data.copy_(t)
        return set()


def _weights(model: Model, seed: int, dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [(f"layers.{i}.weight", torch.randn(8, 4, generator=g, dtype=dtype)) for i in range(len(model.layers))]
    out += [("fused.a", torch.randn(4, 4, generator=g, dtype=dtype)),
            ("fused.b", torch.randn(4, 4, generator=g, dtype=dtype)),
            ("plain.weight", torch.randn(8, 4, generator=g, dtype=dtype))]
    return out


def _loaded(keeps: tuple[bool, ...] = (False, False)) -> Model:
    """Built, recorded, loaded and processed by 'another loader' (as vLLM does its first load)."""
    model = Model(keeps)
    record_metadata_for_reloading(model)
    with torch.no_grad():
        model.load_weights(_weights(model, 0))
    for layer in [*model.layers, model.fused, model.plain]:
        layer.process_weights_after_loading()
    mark_layers_processed(model)
    return model


def _packed(layer: nn.Module) -> torch.Tensor:
    return layer.packed[0]


def test_a_read_only_processor_reads_the_callers_tensor_and_nothing_else_changes() -> None:
    model = _loaded()
    for seed in (1, 2):
        weights = _weights(model, seed)
        kept = {n: t.clone() for n, t in weights}
        report = reload_weights(model, weights_iterator=weights, manifest=Manifest.from_named_tensors(weights))
        src = dict(weights)
        for i, layer in enumerate(model.layers):
            assert layer.input_ptr == src[f"layers.{i}.weight"].data_ptr()  # borrowed, not copied
            assert torch.equal(_packed(layer), src[f"layers.{i}.weight"].t())
        # Not borrowed: a layer with two keys, a processor not declared read-only.
        assert model.fused.input_ptr not in {t.data_ptr() for _, t in weights}
        assert model.plain.input_ptr != src["plain.weight"].data_ptr()
        assert torch.equal(_packed(model.fused), torch.cat([src["fused.a"], src["fused.b"]]))
        assert torch.equal(_packed(model.plain), src["plain.weight"].t())
        assert all(torch.equal(t, kept[n]) for n, t in weights)  # the caller's tensors are untouched
        assert sorted(report.layers_processed) == ["fused", "layers.0", "layers.1", "plain"]
        assert report.keys_replayed == len(weights)
        # The caller may reuse its tensors: the served state does not follow them.
        for _, t in weights:
            t.fill_(7.0)
        assert torch.equal(_packed(model.layers[0]), kept["layers.0.weight"].t())


def test_the_borrowed_tensor_never_serves_as_another_layers_staging() -> None:
    model = _loaded()
    weights = _weights(model, 1)
    reload_weights(model, weights_iterator=weights, manifest=Manifest.from_named_tensors(weights))
    # `plain` has the layers' layout and comes after them: its staging must be a buffer of its own.
    assert model.plain.input_ptr not in {t.data_ptr() for _, t in weights}


@pytest.mark.parametrize("case", ["no manifest, first update", "other dtype"])
def test_without_completion_by_expected_keys_or_with_a_cast_the_input_is_copied(case: str) -> None:
    model = _loaded()
    if case == "other dtype":
        weights = _weights(model, 1, torch.bfloat16)  # cast into the float32 layer: a copy anyway
        manifest: Manifest | None = Manifest.from_named_tensors(weights)
    else:
        weights = _weights(model, 1)
        manifest = None  # nothing expected yet: layers complete at finish, after load() returned
    reload_weights(model, weights_iterator=weights, manifest=manifest)
    src = dict(weights)
    for i, layer in enumerate(model.layers):
        assert layer.input_ptr != src[f"layers.{i}.weight"].data_ptr()
        assert torch.equal(_packed(layer), src[f"layers.{i}.weight"].float().t())


def test_a_processor_that_keeps_its_input_is_processed_again_from_a_copy_and_never_borrows_again() -> None:
    model = _loaded(keeps=(False, True))
    weights = _weights(model, 1)
    with begin_update(model, Manifest.from_named_tensors(weights)) as session:
        session.load(weights)
    report = session.report
    assert report is not None and sorted(report.layers_processed) == ["fused", "layers.0", "layers.1", "plain"]
    keeper = model.layers[1]
    source = dict(weights)["layers.1.weight"]
    assert keeper.kept[0].data_ptr() != source.data_ptr()  # serves from its own copy
    assert torch.equal(keeper.kept[0], source) and torch.equal(_packed(keeper), source.t())
    assert get_state(model).layers["layers.1"].reads_input is False
    assert get_state(model).layers["layers.0"].reads_input is True
    source.fill_(7.0)
    assert not torch.equal(keeper.kept[0], source)


def test_rollback_restores_a_layer_processed_from_a_borrowed_tensor() -> None:
    model = _loaded()
    before = [_packed(layer).clone() for layer in model.layers]
    weights = _weights(model, 1)

    def failing():
        yield from weights[:2]  # both borrowing layers complete
        raise OSError("sender went away")

    with pytest.raises(Exception, match="sender went away"):
        reload_weights(model, weights_iterator=failing(), manifest=Manifest.from_named_tensors(weights),
                       rollback=True)
    for layer, packed in zip(model.layers, before):
        assert torch.equal(_packed(layer), packed)
