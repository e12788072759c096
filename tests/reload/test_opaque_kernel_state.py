"""Layers whose kernel state is not a tensor (vLLM-CPU's prepacked oneDNN handles) and vLLM parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync import Manifest, SourceError, record_metadata_for_reloading, reload_weights
from weight_sync.layers import capture_layer, rematerialize
from weight_sync.reload import mark_layers_processed


class _Handle:
    """Stands in for a oneDNN handle: a packed copy of the weight that is not a graph-visible tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = weight.detach().t().contiguous().clone()


class Prepacked(nn.Module):
    """Processing packs the weight into a handle and empties the parameter, as vLLM does on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        self.handle = _Handle(self.weight)
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.handle.packed


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Prepacked() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"layers.{i}.weight", torch.randn(4, 4, generator=g)) for i in range(3)]


def _loaded_stack(seed: int) -> Stack:
    """A model built, recorded, loaded and processed by 'another loader' (as vLLM does its first load)."""
    model = Stack()
    record_metadata_for_reloading(model)
    with torch.no_grad():
        for (_, w), layer in zip(_weights(seed), model.layers):
            layer.weight.copy_(w)
            layer.process_weights_after_loading()
    mark_layers_processed(model)
    return model


def test_rollback_restores_kernel_state_held_outside_tensors() -> None:
    model, x = _loaded_stack(0), torch.randn(2, 4)
    before = model(x)

    def failing():
        yield from _weights(1)[:2]  # layers 0 and 1 complete and swap their handles
        raise OSError("sender went away")

    manifest = Manifest.from_named_tensors(_weights(1))  # announced: layers complete as they arrive
    with pytest.raises(SourceError, match=r"layers\.1\.weight"):
        reload_weights(model, weights_iterator=failing(), manifest=manifest, rollback=True)
    assert torch.equal(model(x), before)


def test_a_committed_update_keeps_the_new_handles() -> None:
    model, x = _loaded_stack(0), torch.randn(2, 4)
    reload_weights(model, weights_iterator=iter(_weights(1)), rollback=True)
    assert torch.equal(model(x), _loaded_stack(1)(x))


class LoaderParameter(nn.Parameter):
    """Like vLLM's ModelWeightParameter: a constructor that needs a loader and a property in front of it."""

    def __new__(cls, data: torch.Tensor, **kwargs):
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data: torch.Tensor, weight_loader) -> None:
        self._weight_loader = weight_loader

    @property
    def weight_loader(self):
        return self._weight_loader


def test_rematerialized_parameters_keep_a_subclass_whose_constructor_needs_more_arguments() -> None:
    layer = nn.Module()
    layer.weight = LoaderParameter(torch.zeros(2, 3), weight_loader=print)
    record = capture_layer(layer)["weight"]
    for device in ("meta", "cpu"):
        t = rematerialize(record, device)
        assert type(t) is LoaderParameter
        assert t.weight_loader is print
        assert tuple(t.shape) == (2, 3)
