"""The reference engine matches transformers and survives bad input with clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ConfigError, LayoutMismatchError, UnknownTensorError, WeightSyncError
from weight_sync.testing import make_checkpoint

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46]]


def _hf(path: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("ckpt", ["qwen3_a", "llama_tied"])
def test_logits_equal_transformers_in_fp32(ckpt: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(ckpt)
    engine = ReferenceEngine.from_checkpoint(path, dtype=torch.float32)
    with torch.no_grad():
        ref = _hf(path)(torch.tensor(PROMPTS)).logits
    torch.testing.assert_close(engine.logits(PROMPTS), ref)


@pytest.mark.parametrize("ckpt", ["qwen3_a", "llama_tied"])
def test_greedy_tokens_equal_transformers(ckpt: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(ckpt)
    engine = ReferenceEngine.from_checkpoint(path, dtype=torch.float32)
    hf = _hf(path)
    ours = engine.generate(PROMPTS, 10)
    for prompt, got in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist()


def test_batched_prompts_of_different_lengths_match_one_by_one(qwen3_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, dtype=torch.float32)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    batched = engine.generate(prompts, 6)
    assert batched == [engine.generate([p], 6)[0] for p in prompts]


def test_tied_checkpoint_shares_embedding_and_head(llama_tied: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(llama_tied)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight


def test_different_seeds_give_clearly_different_greedy_outputs(tmp_path: Path) -> None:
    outs = []
    for seed in range(3):
        path = make_checkpoint(tmp_path / f"s{seed}", seed=seed)
        outs.append(ReferenceEngine.from_checkpoint(path).generate([[5, 6, 7]], 8)[0])
    for i in range(3):
        for j in range(i + 1, 3):
            assert sum(a != b for a, b in zip(outs[i], outs[j])) >= 4


def test_odd_sizes_load_and_match_transformers(tmp_path: Path) -> None:
    path = make_checkpoint(
        tmp_path / "odd", hidden_size=96, num_attention_heads=3, num_key_value_heads=1,
        head_dim=32, intermediate_size=200, vocab_size=1000, num_hidden_layers=3,
    )
    engine = ReferenceEngine.from_checkpoint(path, dtype=torch.float32)
    with torch.no_grad():
        ref = _hf(path)(torch.tensor(PROMPTS)).logits
    torch.testing.assert_close(engine.logits(PROMPTS), ref)


def test_checkpoint_directory_missing_weights_names_the_directory(qwen3_a: Path, tmp_path: Path) -> None:
    broken = tmp_path / "no_weights"
    broken.mkdir()
    shutil.copy(qwen3_a / "config.json", broken / "config.json")
    with pytest.raises(WeightSyncError, match=r"no_weights: no weights found \(expected \*\.safetensors"):
        ReferenceEngine.from_checkpoint(broken)


def test_checkpoint_directory_missing_config_names_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        ReferenceEngine.from_checkpoint(tmp_path)


def test_unsupported_architecture_is_rejected_with_the_supported_list(qwen3_a: Path, tmp_path: Path) -> None:
    other = tmp_path / "gpt2ish"
    shutil.copytree(qwen3_a, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel.*not supported.*Qwen3ForCausalLM"):
        ReferenceEngine.from_checkpoint(other)


def test_load_weights_rejects_a_wrong_shape_naming_the_tensor_and_expectation(qwen3_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    bad = torch.zeros(7, 128, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatchError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*64 rows.*\(7, 128\)"):
        engine.model.load_weights([("model.layers.0.self_attn.k_proj.weight", bad)])
    with pytest.raises(LayoutMismatchError, match=r"model\.norm\.weight: expects \(128,\) bfloat16, got \(64,\)"):
        engine.model.load_weights([("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))])


def test_load_weights_rejects_an_unknown_name(qwen3_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    with pytest.raises(UnknownTensorError, match=r"model\.layers\.9\.mlp\.up_proj\.weight"):
        engine.model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(256, 128))])


def test_generate_rejects_out_of_range_tokens_and_overlong_requests(qwen3_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, max_seq_len=32)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 1024\)"):
        engine.generate([[5, 5000]], 2)
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        engine.generate([[5] * 30], 5)
