"""Reload on modules that are not the reference engine: plain modules, custom processors, aliases."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from weight_sync import (
    PointerChangedError,
    begin_update,
    finalize_layerwise_processing,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
    reload_weights,
)
from weight_sync.layers import signatures
from weight_sync.reload import register_post_update_hook


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.register_buffer("scale", torch.ones(4))


def _plain_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=g)) for n, t in Plain().state_dict().items()]


def test_a_plain_module_without_load_weights_reloads_by_copy() -> None:
    model = Plain()
    record_metadata_for_reloading(model)
    weights = _plain_weights(1)
    report = reload_weights(model, weights_iterator=iter(weights))
    for name, t in weights:
        assert torch.equal(model.state_dict()[name], t)
    assert len(report.layers_direct) == 4 and not report.layers_processed


class Transposed(nn.Module):
    """A layer that stores its weight transposed and owns a derived workspace tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3, 5), requires_grad=False)
        self.weight.weight_loader = self.load
        self.processed_calls = 0

    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        # A computed source (transpose + contiguous): not replayable as a copy, so the real loader runs.
        param.data.copy_(loaded.t().contiguous())

    def process_weights_after_loading(self) -> None:
        if getattr(self, "_already_processed", False):
            return  # the seed's guard against processing twice; reload must reset it
        self.processed_calls += 1
        w = self.weight.detach()
        self.weight = nn.Parameter((w * 2).t().contiguous(), requires_grad=False)  # kernel: (5, 3)
        self.workspace = w.sum(0)  # a plain tensor attribute a kernel would read
        self._already_processed = True


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Transposed() for _ in range(2))

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].weight_loader(params[name], t)


def _net_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"blocks.{i}.weight", torch.randn(5, 3, generator=g)) for i in range(2)]


def _fresh_net(weights) -> Net:
    net = Net()
    record_metadata_for_reloading(net)
    reload_weights(net, weights_iterator=iter(weights))
    return net


def test_processor_outputs_and_tensor_attributes_are_copied_into_live_storage() -> None:
    net = _fresh_net(_net_weights(0))
    before = signatures(net)
    assert "blocks.0.workspace" in before
    report = reload_weights(net, weights_iterator=iter(_net_weights(1)))
    assert signatures(net) == before
    expected = _fresh_net(_net_weights(1))
    for a, b in zip(net.blocks, expected.blocks):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.workspace, b.workspace)
        assert a.processed_calls == 2  # the "already processed" flag did not block the reload
    assert report.keys_via_loader == 2 and report.keys_replayed == 0
    assert set(report.layers_processed) == {"blocks.0", "blocks.1"}


def test_a_processor_that_changes_a_kernel_shape_fails_loudly_and_rolls_back() -> None:
    net = _fresh_net(_net_weights(0))
    snapshot = {k: v.clone() for k, v in net.state_dict().items()}

    def bad(self: Transposed) -> None:
        self.weight = nn.Parameter(torch.zeros(2, 2), requires_grad=False)
        self.workspace = torch.zeros(3)

    from weight_sync.reload.state import get_state

    get_state(net).layers["blocks.1"].processor = bad
    with pytest.raises(Exception, match=r"blocks\.1\.weight: kernel tensor is \(5, 3\) float32, processing produced \(2, 2\)"):
        reload_weights(net, weights_iterator=iter(_net_weights(1)), rollback=True)
    for k, v in net.state_dict().items():
        assert torch.equal(v, snapshot[k])


def test_a_post_update_hook_that_swaps_a_tensor_is_caught_by_pointer_verification() -> None:
    model = Plain()
    record_metadata_for_reloading(model)
    reload_weights(model, weights_iterator=iter(_plain_weights(0)))
    calls = []

    def hook(m: nn.Module) -> None:
        calls.append(1)
        m.layers[0].bias = nn.Parameter(torch.zeros(4))  # a new tensor: graphs would read the old one

    register_post_update_hook(model, hook)
    with pytest.raises(PointerChangedError, match=r"layers\.0\.bias"):
        reload_weights(model, weights_iterator=iter(_plain_weights(1)))
    assert calls == [1]


def test_the_seed_aliases_route_plain_load_weights_into_the_session() -> None:
    net = _fresh_net(_net_weights(0))
    initialize_layerwise_reload(net)
    net.load_weights(_net_weights(1))
    report = finalize_layerwise_processing(net)
    assert "load_weights" not in net.__dict__
    expected = _fresh_net(_net_weights(1))
    for a, b in zip(net.blocks, expected.blocks):
        assert torch.equal(a.weight, b.weight)
    assert report.num_tensors == 2


def test_the_session_context_manager_aborts_on_error_and_restores_processed_layers() -> None:
    net = _fresh_net(_net_weights(0))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(KeyError), begin_update(net, rollback=True) as s:
        s.load(_net_weights(1)[:1])
        raise KeyError("boom")
    assert net.blocks[0].weight.shape == (5, 3)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_model_recorded_after_its_linears_were_quantized_refuses_full_precision_updates_naming_the_tensor() -> None:
    from weight_sync import Manifest, ManifestError, begin_update, record_metadata_for_reloading
    from weight_sync.quant.modules import quantize_linears

    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    weights = [(n, torch.randn_like(t)) for n, t in model.state_dict().items()]
    quantize_linears(model, "fp8_block")  # kernel format now: fp8 bytes and scales
    record_metadata_for_reloading(model)  # too late: the recorded layout is the fp8 one
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ManifestError, match=r"0\.weight holds float8_e4m3fn .* brings float32"):
        begin_update(model, Manifest.from_named_tensors(weights))
    after = model.state_dict()
    assert all(torch.equal(after[k].view(torch.uint8) if v.dtype.itemsize == 1 else after[k],
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v) for k, v in before.items())
