"""Tiny HF-format checkpoints made locally: config.json, model.safetensors and a character tokenizer.

No network, ever. Weights are random (std ~0.2 on matrices at hidden 128, scaled down for wider models) so
that different seeds give clearly different greedy outputs. The tokenizer maps each printable ASCII
character to one token, so "3 4 = 12" round-trips exactly.

``arch="qwen3_moe"`` writes a Qwen3-MoE checkpoint with HF's config keys (``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers``,
``norm_topk_prob``) and tensor names (``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``);
its presets are :data:`MOE_PRESETS`. Large presets (``qwen3-8b``, ``qwen3-30b-a3b``) are meant for
``hf_config`` + ``random_weights`` on the device, not for writing to disk.
"""

from __future__ import annotations

import json
import os
import string
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from weight_sync.errors import ConfigError

__all__ = [
    "ARCHS",
    "MOE_PRESETS",
    "PRESETS",
    "hf_config",
    "make_checkpoint",
    "random_weights",
    "write_tokenizer",
]

ARCHS = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=1024, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, intermediate_size=256),
    "small": dict(vocab_size=1024, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=1408),
    # ~30M parameters: big enough that reload times are measurable on CPU.
    "bench": dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, intermediate_size=2048),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                     tie_word_embeddings=False),
}

# Presets of arch "qwen3_moe": full shapes (dense fields + the MoE fields of HF's Qwen3MoeConfig).
# ``intermediate_size`` is the width of the dense MLP of layers outside the sparse schedule (mlp_only_layers).
MOE_PRESETS: dict[str, dict[str, Any]] = {
    # 8 experts, top-2: routing differs visibly between tokens; moe_intermediate_size 64 splits over TP=2.
    "tiny": dict(PRESETS["tiny"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
    # The shape of Qwen/Qwen3-30B-A3B (48 layers, 128 experts, top-8): 30.5B parameters, for benchmarks
    # through hf_config + random_weights (61 GB in bf16: not something to write to disk by default).
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          tie_word_embeddings=False, max_position_embeddings=40960, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1,
                          mlp_only_layers=[], norm_topk_prob=True),
}

_MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step",
             "mlp_only_layers", "norm_topk_prob")

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]  # 95 printable incl. space


def hf_config(arch: str = "qwen3", preset: str = "tiny", dtype: torch.dtype = torch.bfloat16,
              **overrides: Any) -> dict[str, Any]:
    """The config.json dict for ``arch`` / ``preset`` with ``overrides`` applied."""
    if arch not in ARCHS:
        raise ConfigError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    presets = MOE_PRESETS if arch == "qwen3_moe" else PRESETS
    if preset not in presets:
        raise ConfigError(f"preset must be one of {sorted(presets)} for arch {arch!r}, got {preset!r}")
    p = {**presets[preset], **overrides}
    dtype_name = str(dtype).removeprefix("torch.")
    cfg: dict[str, Any] = {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": p["vocab_size"],
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": p.get("max_position_embeddings", 4096),
        "rms_norm_eps": p.get("rms_norm_eps", 1e-6),
        "rope_theta": p.get("rope_theta", 1_000_000.0 if arch == "qwen3" else 10_000.0),
        "rope_scaling": None,
        "tie_word_embeddings": p.get("tie_word_embeddings", arch == "llama" and preset == "tiny"),
        "attention_bias": p.get("attention_bias", False),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if arch == "qwen3_moe":
        # HF's Qwen3MoeConfig fields, in its order; the router's aux loss only matters for training.
        cfg.update({k: p[k] for k in _MOE_KEYS})
        cfg["mlp_only_layers"] = list(cfg["mlp_only_layers"])
        cfg["output_router_logits"] = False
        cfg["router_aux_loss_coef"] = 0.001
    if arch == "llama":
        cfg["mlp_bias"] = False
        cfg["pretraining_tp"] = 1
    else:
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    for k, v in overrides.items():
        cfg[k] = v
    if cfg["hidden_size"] < 1 or cfg["num_attention_heads"] < 1:
        raise ConfigError(f"hidden_size and num_attention_heads must be positive, got {cfg}")
    return cfg


def is_moe_layer(cfg: dict[str, Any], index: int) -> bool:
    """Whether layer ``index`` of ``cfg`` is a sparse MoE block (HF's Qwen3MoeDecoderLayer rule)."""
    experts = cfg.get("num_experts") or 0
    step = cfg.get("decoder_sparse_step") or 1
    return experts > 0 and index not in (cfg.get("mlp_only_layers") or []) and (index + 1) % step == 0


def num_tensors(cfg: dict[str, Any]) -> int:
    """How many tensors :func:`random_weights` yields for ``cfg``."""
    per_layer = 8 if cfg["architectures"][0].startswith("Qwen3") else 6
    per_layer += 3 if cfg.get("attention_bias", False) else 0
    n = 2 + (0 if cfg.get("tie_word_embeddings", False) else 1)
    for i in range(cfg["num_hidden_layers"]):
        n += per_layer + (1 + 3 * cfg["num_experts"] if is_moe_layer(cfg, i) else 3)
    return n


def random_weights(
    cfg: dict[str, Any], *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield HF-named random tensors for ``cfg`` in block order (generated on ``device``)."""
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    std = min(0.2, 0.2 * (128 / h) ** 0.5)

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g, device=device) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    yield "model.embed_tokens.weight", mat(v, h)
    qwen3 = cfg["architectures"][0].startswith("Qwen3")
    bias = cfg.get("attention_bias", False)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", norm(h)
        yield p + "self_attn.q_proj.weight", mat(nh * hd, h)
        yield p + "self_attn.k_proj.weight", mat(nkv * hd, h)
        yield p + "self_attn.v_proj.weight", mat(nkv * hd, h)
        if bias:
            for part, n in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                yield p + f"self_attn.{part}_proj.bias", (0.1 * torch.randn(n, generator=g, device=device)).to(dtype)
        yield p + "self_attn.o_proj.weight", mat(h, nh * hd)
        if qwen3:
            yield p + "self_attn.q_norm.weight", norm(hd)
            yield p + "self_attn.k_norm.weight", norm(hd)
        yield p + "post_attention_layernorm.weight", norm(h)
        if is_moe_layer(cfg, i):
            # HF order: the router, then every expert's gate, up and down projections.
            moe = cfg["moe_intermediate_size"]
            yield p + "mlp.gate.weight", mat(cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                yield p + f"mlp.experts.{e}.gate_proj.weight", mat(moe, h)
                yield p + f"mlp.experts.{e}.up_proj.weight", mat(moe, h)
                yield p + f"mlp.experts.{e}.down_proj.weight", mat(h, moe)
            continue
        yield p + "mlp.gate_proj.weight", mat(inter, h)
        yield p + "mlp.up_proj.weight", mat(inter, h)
        yield p + "mlp.down_proj.weight", mat(h, inter)
    yield "model.norm.weight", norm(h)
    if not cfg.get("tie_word_embeddings", False):
        yield "lm_head.weight", mat(v, h)


def write_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """Write a character-level fast tokenizer (tokenizer.json + configs) with ``vocab_size`` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    base = SPECIAL_TOKENS + CHARS
    if vocab_size < len(base):
        raise ConfigError(f"vocab_size must be >= {len(base)} for the character tokenizer, got {vocab_size}")
    vocab = {tok: i for i, tok in enumerate(base)}
    for i in range(len(base), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    path = Path(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": 4096, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }, indent=1))
    (path / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
    }, indent=1))


def make_checkpoint(
    path: str | os.PathLike,
    *,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Write an HF model directory that transformers and vLLM can load; returns its path.

    ``config_overrides`` change any config field (``hidden_size=96, num_attention_heads=3, head_dim=32``;
    for ``arch="qwen3_moe"`` also ``num_experts=4, mlp_only_layers=[1]``).
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(arch, preset, dtype, **config_overrides)
    count = num_tensors(cfg)
    weights: Iterable[tuple[str, torch.Tensor]] = random_weights(cfg, seed=seed, dtype=dtype)
    # A bar only where it takes seconds (the 0.6B/8B-shaped presets), and only on a terminal: tqdm starts
    # a monitor thread that lives as long as the process even for a disabled bar.
    if count > 100 and sys.stderr.isatty():
        from tqdm.auto import tqdm

        weights = tqdm(weights, total=count, unit="tensor", desc=f"generating {arch}/{preset}", leave=False)
    tensors = {n: t.contiguous() for n, t in weights}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}, indent=1
    ))
    if tokenizer:
        write_tokenizer(path, cfg["vocab_size"])
    return path
