"""The Qwen3-MoE reference engine matches transformers, reloads bitwise and refuses bad expert tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync.engine import ModelConfig, ReferenceEngine
from weight_sync.engine.moe import FusedMoE, make_expert_params_mapping
from weight_sync.errors import ConfigError, LayoutMismatchError, ManifestError, UnknownTensorError
from weight_sync.manifest import Manifest
from weight_sync.quant import Fp8Config, Fp8FusedMoEMethod, dequantize_fp8, quantize_fp8
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal, hf_config, make_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def moe_a(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("moe") / "a", arch="qwen3_moe", seed=0, tokenizer=False)


@pytest.fixture(scope="module")
def moe_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("moe") / "b", arch="qwen3_moe", seed=1, tokenizer=False)


def _hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("overrides", [
    {},
    # Dense layers among sparse ones (mlp_only_layers, decoder_sparse_step) and unnormalized top-k.
    {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3], "norm_topk_prob": False,
     "num_experts": 4, "num_experts_per_tok": 3},
], ids=["tiny", "mixed_dense_unnormalized"])
def test_moe_logits_equal_transformers_in_fp32(overrides: dict, tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", arch="qwen3_moe", tokenizer=False, **overrides)
    engine = ReferenceEngine.from_checkpoint(path, dtype=torch.float32)
    with torch.no_grad():
        ref = _hf(path)(torch.tensor(PROMPTS)).logits
    torch.testing.assert_close(engine.logits(PROMPTS), ref)


def test_moe_greedy_tokens_equal_transformers(moe_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(moe_a, dtype=torch.float32)
    hf = _hf(moe_a)
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert engine.generate([prompt], 8)[0] == ref[0, len(prompt):].tolist()


def test_experts_are_stored_fused_as_vllm_stores_them(moe_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(moe_a)
    experts = engine.model.model.layers[1].mlp.experts
    ckpt = dict(iter_checkpoint(moe_a))
    p = "model.layers.1.mlp.experts.6."
    assert experts.w13_weight.shape == (8, 128, 128) and experts.w2_weight.shape == (8, 128, 64)
    assert torch.equal(experts.w13_weight[6, :64], ckpt[p + "gate_proj.weight"])  # w1 = gate, first
    assert torch.equal(experts.w13_weight[6, 64:], ckpt[p + "up_proj.weight"])  # w3 = up, second
    assert torch.equal(experts.w2_weight[6], ckpt[p + "down_proj.weight"])
    assert torch.equal(engine.model.model.layers[1].mlp.gate.weight, ckpt["model.layers.1.mlp.gate.weight"])


def test_expert_params_mapping_is_vllms() -> None:
    mapping = make_expert_params_mapping("gate_proj", "down_proj", "up_proj", 2)
    assert mapping == [
        ("experts.w13_", "experts.0.gate_proj.", 0, "w1"),
        ("experts.w2_", "experts.0.down_proj.", 0, "w2"),
        ("experts.w13_", "experts.0.up_proj.", 0, "w3"),
        ("experts.w13_", "experts.1.gate_proj.", 1, "w1"),
        ("experts.w2_", "experts.1.down_proj.", 1, "w2"),
        ("experts.w13_", "experts.1.up_proj.", 1, "w3"),
    ]


@pytest.mark.parametrize("quant", [None, "fp8", "fp8_block"])
def test_moe_reload_b_into_a_equals_fresh_b_bitwise(quant, moe_a: Path, moe_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(moe_a, quantization=quant)
    fresh_b = ReferenceEngine.from_checkpoint(moe_b, quantization=quant)
    report = engine.reload_weights(moe_b)
    assert_bitwise_equal(engine.model, fresh_b.model)
    assert engine.logits(PROMPTS).equal(fresh_b.logits(PROMPTS))
    # The experts layer is processed (quantized) as one layer on every update; the router never is.
    processed = "model.layers.0.mlp.experts" in report.layers_processed
    assert processed == (quant is not None)
    assert "model.layers.0.mlp.gate" in report.layers_direct


def test_fp8_experts_keep_one_scale_per_expert_and_block_scales_per_tile(moe_a: Path) -> None:
    ckpt = dict(iter_checkpoint(moe_a))
    p = "model.layers.0.mlp.experts.2."
    w13 = torch.cat([ckpt[p + "gate_proj.weight"], ckpt[p + "up_proj.weight"]])
    tensor = ReferenceEngine.from_checkpoint(moe_a, quantization="fp8").model.model.layers[0].mlp.experts
    assert tensor.w13_weight.dtype == torch.float8_e4m3fn
    assert tensor.w13_weight_scale.shape == (8,) and tensor.w2_weight_scale.shape == (8,)
    # Expert 2's bytes and scale are exactly those of quantizing its [gate; up] matrix alone.
    q, s = quantize_fp8(w13, Fp8Config(granularity="tensor"))
    assert torch.equal(tensor.w13_weight[2].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(tensor.w13_weight_scale[2], s.reshape(()))
    block = ReferenceEngine.from_checkpoint(moe_a, quantization="fp8_block").model.model.layers[0].mlp.experts
    # 128x128 tiles: w13 [8, 128, 128] -> one tile per expert; w2 [8, 128, 64] -> one ragged tile.
    assert block.w13_weight_scale_inv.shape == (8, 1, 1) and block.w2_weight_scale_inv.shape == (8, 1, 1)
    cfg = Fp8Config(granularity="block")
    back = dequantize_fp8(block.w13_weight[2], block.w13_weight_scale_inv[2], cfg, torch.float32)
    torch.testing.assert_close(back, w13.float(), rtol=0.07, atol=0.02)


def test_graph_capturable_expert_path_equals_the_sparse_path(moe_a: Path) -> None:
    experts = ReferenceEngine.from_checkpoint(moe_a, dtype=torch.float32).model.model.layers[0].mlp.experts
    assert isinstance(experts, FusedMoE)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=g)
    # The same contributions in the same order; only the matmul over more rows may round differently.
    torch.testing.assert_close(experts.forward_dense(x, weights, ids), experts(x, weights, ids))


def test_a_wrong_expert_shape_is_refused_naming_the_tensor_and_expectation(moe_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(moe_a)
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    with pytest.raises(LayoutMismatchError,
                       match=rf"{name}: expert 3 shard 'w3' expects \(64, 128\), got \(64, 100\) bfloat16"):
        engine.model.load_weights([(name, torch.zeros(64, 100, dtype=torch.bfloat16))])
    down = "model.layers.1.mlp.experts.0.down_proj.weight"
    with pytest.raises(LayoutMismatchError, match=rf"{down}: expert 0 shard 'w2' expects \(128, 64\)"):
        engine.model.load_weights([(down, torch.zeros(64, 128, dtype=torch.bfloat16))])


def test_an_unknown_expert_id_is_refused_naming_the_tensor(moe_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(moe_a)
    name = "model.layers.0.mlp.experts.8.gate_proj.weight"
    with pytest.raises(UnknownTensorError, match=rf"{name}: .*8 experts \(ids 0\.\.7\).*got expert 8"):
        engine.model.load_weights([(name, torch.zeros(64, 128, dtype=torch.bfloat16))])
    experts = engine.model.model.layers[0].mlp.experts
    with pytest.raises(UnknownTensorError, match=r"w13_weight: expert id must be in \[0, 8\), got 9"):
        experts.weight_loader(experts.w13_weight, torch.zeros(64, 128), "w13_weight", "w1", 9)
    with pytest.raises(LayoutMismatchError, match=r"shard id must be 'w1', 'w2' or 'w3', got 'w4'"):
        experts.weight_loader(experts.w13_weight, torch.zeros(64, 128), "w13_weight", "w4", 0)


def test_a_manifest_with_a_bad_expert_is_rejected_before_any_write(moe_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(moe_a, quantization="fp8")
    before = engine.fingerprint()
    items = list(iter_checkpoint(moe_a))
    bad = "model.layers.1.mlp.experts.5.down_proj.weight"
    items = [(n, torch.zeros(128, 65, dtype=t.dtype) if n == bad else t) for n, t in items]
    items.append(("model.layers.1.mlp.experts.11.up_proj.weight", torch.zeros(64, 128)))
    with pytest.raises(ManifestError) as info:
        engine.begin_update(Manifest.from_named_tensors(items))
    assert f"{bad}: engine expects (128, 64) bfloat16, got (128, 65) bfloat16" in str(info.value)
    assert "experts.11.up_proj.weight: no expert parameter for this key" in str(info.value)
    assert engine.fingerprint() == before and engine.generate([[5, 6]], 2)


def test_expert_keys_for_a_dense_layer_are_refused(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", arch="qwen3_moe", tokenizer=False, mlp_only_layers=[1])
    engine = ReferenceEngine.from_checkpoint(path)
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"
    with pytest.raises(UnknownTensorError, match=rf"{name}: the model has no experts.*mlp_only_layers"):
        engine.model.load_weights([(name, torch.zeros(64, 128, dtype=torch.bfloat16))])


def test_moe_configs_that_cannot_be_built_or_split_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\) must be <= num_experts \(8\)"):
        ModelConfig.from_hf_dict(hf_config("qwen3_moe", num_experts_per_tok=9))
    with pytest.raises(ConfigError, match=r"mlp_only_layers must name layers in \[0, 2\), got \[2\]"):
        ModelConfig.from_hf_dict(hf_config("qwen3_moe", mlp_only_layers=[2]))
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3_moe", num_experts=6, moe_intermediate_size=48))
    with pytest.raises(ConfigError, match=r"expert parallel size 4 must divide num_experts \(6\)"):
        cfg.check_tp(4, expert_parallel=True)
    with pytest.raises(ConfigError, match=r"size 4 must divide moe_intermediate_size \(50\) \(or use expert"):
        ModelConfig.from_hf_dict(hf_config("qwen3_moe", moe_intermediate_size=50)).check_tp(4)
    cfg.check_tp(2, expert_parallel=True)  # 6 experts over 2 ranks: 3 whole experts each
    with pytest.raises(ConfigError, match=r"fp8 granularity 'tensor' or 'block', got 'channel'"):
        Fp8FusedMoEMethod(Fp8Config(granularity="channel"))
    with pytest.raises(ConfigError, match=r"no method for quantization Int8Config"):
        ReferenceEngine.from_config(hf_config("qwen3_moe"), quantization="int8")
