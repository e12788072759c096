"""Staging of processed layers: zero fill only where the plan's copies leave bytes unwritten."""

from __future__ import annotations

import torch
from torch import nn

from weight_sync import Manifest, begin_update, record_metadata_for_reloading
from weight_sync.reload.state import get_state


class Quantized(nn.Module):
    """A processed layer whose loader writes ``rows`` rows of a weight with ``pad`` padding rows."""

    def __init__(self, rows: int, pad: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows + pad, 4), requires_grad=False)
        self.weight.weight_loader = self.load
        self.rows = rows

    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data[: self.rows].copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.seen = self.weight.detach().clone()  # what processing read, padding included


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.full = Quantized(3, 0)
        self.padded = Quantized(3, 2)


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("full.weight", torch.randn(3, 4, generator=g)), ("padded.weight", torch.randn(3, 4, generator=g))]


def test_only_tensors_the_plan_writes_entirely_skip_the_zero_fill_and_padding_reads_zero() -> None:
    model = Model()
    record_metadata_for_reloading(model)
    for seed in (1, 2, 3):
        weights = _weights(seed)
        with begin_update(model, Manifest.from_named_tensors(weights)) as session:
            session.load(weights)
        state = get_state(model)
        assert state.plan is not None
        assert state.plan.fully_written("full", state.layers["full"].records) == {"weight"}
        assert state.plan.fully_written("padded", state.layers["padded"].records) == frozenset()
        assert torch.equal(model.full.seen, weights[0][1])
        assert torch.equal(model.padded.seen[:3], weights[1][1])
        assert torch.equal(model.padded.seen[3:], torch.zeros(2, 4))


class Keeper(nn.Module):
    """A processed layer; with ``keep`` its processor holds on to a view of its input (like a kernel that
    wraps the weight without copying it), else it only records where its input lived."""

    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.keep = keep

    def process_weights_after_loading(self) -> None:
        self.input_ptr = self.weight.data_ptr()
        if self.keep:
            self.kept = [self.weight.detach()]  # not a graph-visible tensor: hidden in a list
        else:
            self.packed = [self.weight.detach().clone()]


class Stack(nn.Module):
    def __init__(self, keeps: list[bool]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Keeper(k) for k in keeps)


def test_staging_is_reused_across_layers_unless_a_processor_still_holds_it() -> None:
    model = Stack([False, False, True, False, False])
    record_metadata_for_reloading(model)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the first update makes the kernel tensors; the second copies into them
        weights = [(f"layers.{i}.weight", torch.randn(8, 4, generator=g)) for i in range(5)]
        with begin_update(model, Manifest.from_named_tensors(weights)) as session:
            session.load(weights)
    ptrs = [layer.input_ptr for layer in model.layers]
    assert ptrs[1] == ptrs[0]  # layer 0's staging came back to the pool and served layer 1
    assert ptrs[3] != ptrs[2]  # layer 2's processor still holds its input: never handed out again
    assert torch.equal(model.layers[2].kept[0], weights[2][1])
    for layer, (_, w) in zip(model.layers, weights):
        if not layer.keep:
            assert torch.equal(layer.packed[0], w)


class PaddedVocab(nn.Module):
    """A processed layer whose loader zero-fills padding rows after the copy, as vLLM's vocab loader does."""

    def __init__(self, rows: int, pad: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows + pad, 4), requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param[: loaded.shape[0]].data.copy_(loaded)
        param[loaded.shape[0] :].data.fill_(0)

    def process_weights_after_loading(self) -> None:
        self.seen = self.weight.detach().clone()


def test_a_zero_fill_of_an_empty_padding_slice_does_not_force_the_real_loader() -> None:
    model = nn.Module()
    model.unpadded = PaddedVocab(6, 0)
    model.padded = PaddedVocab(6, 2)
    record_metadata_for_reloading(model)
    g = torch.Generator().manual_seed(0)
    weights = [("unpadded.weight", torch.randn(6, 4, generator=g)), ("padded.weight", torch.randn(6, 4, generator=g))]
    with begin_update(model, Manifest.from_named_tensors(weights)) as session:
        session.load(weights)
    plan = get_state(model).plan
    assert plan is not None
    assert plan.keys["unpadded.weight"].mode == "copy"  # the fill wrote nothing: plain replayed copies
    assert plan.keys["padded.weight"].mode == "loader"  # a real fill: the loader stays the fallback
    assert torch.equal(model.unpadded.seen, weights[0][1])
    assert torch.equal(model.padded.seen, torch.cat([weights[1][1], torch.zeros(2, 4)]))
