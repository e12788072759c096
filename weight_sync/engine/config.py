"""The reference engine's model config, read from an HF ``config.json`` (Qwen3, Qwen3-MoE, Llama)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from weight_sync.errors import ConfigError

__all__ = ["MODEL_DTYPES", "SUPPORTED_ARCHITECTURES", "ModelConfig"]

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
#: dtypes a model can be built in, by their config.json / CLI names.
MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Shape and numerics of a decoder-only model; ``arch`` is 'qwen3' (q/k norm), 'qwen3_moe' or 'llama'.

    MoE fields (HF's Qwen3MoeConfig): layer ``i`` is a sparse block of ``num_experts`` experts, each an
    MLP of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token, unless ``i`` is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (then a dense MLP of
    ``intermediate_size``). ``norm_topk_prob`` renormalizes the top-k routing weights to sum to one.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    dtype: torch.dtype = torch.bfloat16
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES.values():
            raise ConfigError(
                f"arch must be one of {sorted(SUPPORTED_ARCHITECTURES.values())}, got {self.arch!r}"
            )
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{f} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.arch != "qwen3_moe":
            if self.num_experts:
                raise ConfigError(f"num_experts must be 0 for arch {self.arch!r}, got {self.num_experts}")
            return
        for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{f} must be a positive int for arch 'qwen3_moe', got {v!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts "
                f"({self.num_experts})"
            )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(
                f"mlp_only_layers must name layers in [0, {self.num_hidden_layers}), got {list(bad)}"
            )

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` is a sparse MoE block (HF's Qwen3MoeDecoderLayer rule)."""
        return (
            self.num_experts > 0
            and index not in self.mlp_only_layers
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def check_tp(self, tp_size: int, *, expert_parallel: bool = False) -> None:
        """Raise ConfigError unless the model can be split over ``tp_size`` ranks.

        Experts are split inside (their intermediate width) or, with ``expert_parallel``, whole
        experts over the ranks.
        """
        if self.num_attention_heads % tp_size:
            raise ConfigError(
                f"tensor parallel size {tp_size} must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        kv = self.num_key_value_heads
        if (kv >= tp_size and kv % tp_size) or (kv < tp_size and tp_size % kv):
            raise ConfigError(
                f"tensor parallel size {tp_size} and num_key_value_heads {kv}: one must divide the other"
            )
        dense_layers = self.num_hidden_layers - self.num_moe_layers
        if dense_layers and self.intermediate_size % tp_size:
            raise ConfigError(
                f"tensor parallel size {tp_size} must divide intermediate_size ({self.intermediate_size})"
            )
        if not self.num_moe_layers:
            return
        if expert_parallel and self.num_experts % tp_size:
            raise ConfigError(
                f"expert parallel size {tp_size} must divide num_experts ({self.num_experts}): every "
                "rank holds the same number of whole experts"
            )
        if not expert_parallel and self.moe_intermediate_size % tp_size:
            raise ConfigError(
                f"tensor parallel size {tp_size} must divide moe_intermediate_size "
                f"({self.moe_intermediate_size}) (or use expert_parallel=True)"
            )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], *, source: str = "config") -> ModelConfig:
        """Build from an HF config dict; unsupported architectures and rope types are rejected."""
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = d.get("model_type")
            arch = mt if mt in SUPPORTED_ARCHITECTURES.values() else None
        if arch is None:
            raise ConfigError(
                f"{source}: architecture {archs or d.get('model_type')!r} is not supported by the "
                f"reference engine; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported (only 'default')")
        theta = d.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None)
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            dtype_name = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
            return cls(
                arch=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                intermediate_size=int(d["intermediate_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta if theta is not None else 10000.0),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                dtype=MODEL_DTYPES.get(str(dtype_name), torch.bfloat16),
                **(_moe_fields(d) if arch == "qwen3_moe" else {}),
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelConfig:
        """Read ``config.json`` from a model directory."""
        p = Path(path)
        cfg = p / "config.json" if p.is_dir() else p
        if not cfg.is_file():
            raise ConfigError(f"{p}: no config.json (expected an HF model directory)")
        try:
            d = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg}: invalid JSON: {e}") from e
        return cls.from_hf_dict(d, source=str(cfg))

    def to_dict(self) -> dict[str, Any]:
        """Fields by name (dtype as its name); ``ModelConfig(**to_dict())`` with a torch dtype rebuilds it."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["dtype"] = str(self.dtype).removeprefix("torch.")
        return out


def _moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The Qwen3MoeConfig fields of an HF config dict (HF's defaults where absent)."""
    return {
        "num_experts": int(d.get("num_experts", 128)),
        "num_experts_per_tok": int(d.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(d.get("moe_intermediate_size", 768)),
        "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
        "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
    }
