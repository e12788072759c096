"""make_checkpoint(arch="qwen3_moe") writes what transformers' Qwen3MoeForCausalLM loads, with HF's names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from weight_sync.engine import CausalLM, ModelConfig
from weight_sync.errors import ConfigError
from weight_sync.safetensors_io import read_header
from weight_sync.testing import hf_config, make_checkpoint
from weight_sync.testing.checkpoint import num_tensors

transformers = pytest.importorskip("transformers")


def test_moe_checkpoint_has_hf_config_keys_and_expert_tensor_names(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", arch="qwen3_moe", tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["model_type"] == "qwen3_moe"
    hf_fields = set(transformers.Qwen3MoeConfig.__dataclass_fields__)
    moe_keys = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
                "mlp_only_layers", "norm_topk_prob"}
    assert moe_keys <= hf_fields and moe_keys <= set(cfg)
    hdr = read_header(path / "model.safetensors")
    assert hdr["model.layers.1.mlp.gate.weight"].shape == (8, 128)
    assert hdr["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (64, 128)
    assert hdr["model.layers.1.mlp.experts.7.up_proj.weight"].shape == (64, 128)
    assert hdr["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (128, 64)
    assert "model.layers.1.mlp.gate_proj.weight" not in hdr and len(hdr) == num_tensors(cfg)


def test_transformers_loads_every_tensor_and_fuses_gate_then_up(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = make_checkpoint(tmp_path / "m", arch="qwen3_moe", tokenizer=False, mlp_only_layers=[1])
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    sd = load_file(str(path / "model.safetensors"))
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj[5]
    p = "model.layers.0.mlp.experts.5."
    assert torch.equal(gate_up, torch.cat([sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]]).float())
    assert type(model.model.layers[1].mlp).__name__ == "Qwen3MoeMLP"  # mlp_only_layers=[1] is dense


def test_30b_a3b_preset_has_qwen3_30b_a3b_shape_without_materializing_weights() -> None:
    cfg = hf_config("qwen3_moe", "qwen3-30b-a3b")
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_experts"], cfg["num_experts_per_tok"],
            cfg["moe_intermediate_size"]) == (48, 2048, 128, 8, 768)
    model = CausalLM(ModelConfig.from_hf_dict(cfg), device="meta")
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * 8 // 128
    assert total == 30_532_122_624 and 3.3e9 < active < 3.4e9  # Qwen3-30B-A3B: 30.5B, 3.3B active
    assert num_tensors(cfg) == 2 + 1 + 48 * (8 + 1 + 3 * 128)  # weights: random_weights, on the device


def test_moe_presets_are_refused_for_dense_archs_with_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"preset must be one of \[.*'qwen3-8b'.*\] for arch 'qwen3'"):
        hf_config("qwen3", "qwen3-30b-a3b")
    with pytest.raises(ConfigError, match=r"preset must be one of \['qwen3-30b-a3b', 'tiny'\]"):
        hf_config("qwen3_moe", "small")
