"""LoRA adapters are merged into their base weights as they are sent (peft layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.trainers.conftest import load_hf
from trainers import ModuleSource, find_lora_layers


class FakeLoraLinear(nn.Module):
    """peft's LoRA Linear layout, without peft: base_layer, lora_A/lora_B ModuleDicts, scaling."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, adapters: tuple[str, ...] = ("default",)) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({a: nn.Linear(base.in_features, r, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(r, base.out_features, bias=False) for a in adapters})
        self.scaling = {a: alpha / r for a in adapters}
        self.active_adapters = list(adapters)
        self.merged_adapters: list[str] = []
        for a in adapters:
            nn.init.normal_(self.lora_B[a].weight)


def _toy(adapters: tuple[str, ...] = ("default",)) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module() for _ in range(2)])
    for block in model.layers:
        block.proj = FakeLoraLinear(nn.Linear(8, 6), r=2, alpha=4.0, adapters=adapters)
    return model


def test_merged_weight_is_base_plus_scaled_b_times_a_under_the_base_name() -> None:
    model = _toy()
    source = ModuleSource(model)
    assert list(source.manifest().names) == [
        "layers.0.proj.weight", "layers.0.proj.bias", "layers.1.proj.weight", "layers.1.proj.bias",
    ]
    sent = dict(source)
    for i, block in enumerate(model.layers):
        layer = block.proj
        expected = (layer.base_layer.weight.float()
                    + layer.scaling["default"] * (layer.lora_B["default"].weight @ layer.lora_A["default"].weight)).to(
            layer.base_layer.weight.dtype)
        assert torch.equal(sent[f"layers.{i}.proj.weight"], expected.detach())
        assert torch.equal(sent[f"layers.{i}.proj.bias"], layer.base_layer.bias.detach())
    # The trainer's own weights are not modified by sending.
    assert not torch.equal(sent["layers.0.proj.weight"], model.layers[0].proj.base_layer.weight)


def test_every_active_adapter_is_merged_and_already_merged_ones_are_not_added_twice() -> None:
    model = _toy(adapters=("a", "b"))
    layer = model.layers[0].proj
    layer.merged_adapters = ["b"]
    spec = find_lora_layers(model)["layers.0.proj"]
    assert [f.adapter for f in spec.factors] == ["a"]
    layer.active_adapters = []
    assert find_lora_layers(model)["layers.0.proj"].factors == ()


def test_merge_matches_peft_merge_and_unload(qwen3_b: Path) -> None:
    peft = pytest.importorskip("peft")
    base = load_hf(qwen3_b, torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    source = ModuleSource(model)
    reference = {n: p.detach().clone() for n, p in load_hf(qwen3_b, torch.float32).named_parameters()}
    assert list(source.manifest().names) == list(reference)  # peft's wrapper names are gone
    sent = dict(source)
    merged = dict(model.merge_and_unload().named_parameters())
    for name, t in sent.items():
        torch.testing.assert_close(t, merged[name].detach(), rtol=1e-5, atol=1e-6)
    changed = [n for n in sent if not torch.equal(sent[n], reference[n])]
    assert any("q_proj" in n for n in changed) and any("embed_tokens" in n for n in changed)
    assert not any("k_proj" in n for n in changed)
