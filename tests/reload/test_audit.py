"""The finish audit re-checks the begin walk by index and still sees every way a tensor can move."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from weight_sync import PointerChangedError, begin_update, record_metadata_for_reloading
from weight_sync.layers import signatures
from weight_sync.reload.audit import take_baseline, verify_baseline


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2, bias=False)
        self.register_buffer("scale", torch.ones(4))
        self.layers[1].workspace = torch.zeros(8)  # a plain tensor attribute is graph-visible too


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=g)) for n, t in Net().state_dict().items()]


def test_the_baseline_has_exactly_the_signatures_of_the_full_walk() -> None:
    net = Net()
    net.tied = net.layers[2]  # a module reachable twice is walked once, under its first name
    assert take_baseline(net).signatures == signatures(net)


def _rebind_parameter(net: Net) -> None:
    net.layers[1].weight = nn.Parameter(net.layers[1].weight.detach().clone())


def _swap_storage(net: Net) -> None:
    net.layers[2].bias.data = torch.zeros(4)


def _resize_in_place(net: Net) -> None:
    net.scale.resize_(8)


def _replace_module(net: Net) -> None:
    net.layers[0] = nn.Linear(4, 4)


def _rebind_attribute(net: Net) -> None:
    net.layers[1].workspace = torch.zeros(8)


@pytest.mark.parametrize("move", [_rebind_parameter, _swap_storage, _resize_in_place, _replace_module,
                                  _rebind_attribute])
def test_a_tensor_moved_while_the_update_is_open_fails_the_finish(move: Callable[[Net], None]) -> None:
    net = Net()
    record_metadata_for_reloading(net)
    session = begin_update(net)
    session.load(_weights(1))
    move(net)  # the caller's own code, between loads: nothing of weight_sync ran there
    with pytest.raises(PointerChangedError, match="changed during the update"):
        session.finish()
    assert session.status == "aborted"


def test_an_unchanged_model_passes_the_indexed_check_without_the_full_walk(monkeypatch) -> None:
    net = Net()
    base = take_baseline(net)
    for p in net.parameters():
        p.data.add_(1.0)  # values change in place: addresses do not
    walked: list[int] = []
    monkeypatch.setattr("weight_sync.reload.audit.verify_signatures", lambda *a: walked.append(1))
    verify_baseline(net, base)
    assert walked == []


def test_layers_exempted_as_first_processed_may_get_new_tensors() -> None:
    net = Net()
    base = take_baseline(net)
    net.layers[0] = nn.Linear(4, 4)
    verify_baseline(net, base, ("layers.0.",))
    with pytest.raises(PointerChangedError, match=r"layers\.0\.weight"):
        verify_baseline(net, base, ("layers.1.",))
