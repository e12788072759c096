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
