"""A Qwen3 / Qwen3-MoE / Llama decoder with fused qkv, gate_up and experts, and vLLM-style ``load_weights``."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from weight_sync.engine.config import ModelConfig
from weight_sync.engine.moe import SparseMoeBlock, expert_target
from weight_sync.engine.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPInfo,
    VocabParallelEmbedding,
)
from weight_sync.errors import LayoutMismatchError, UnknownTensorError
from weight_sync.layers.loading import default_weight_loader
from weight_sync.quant.registry import make_linear_method

__all__ = ["CausalLM", "KVCache", "RMSNorm"]

# (fused parameter, checkpoint sub-name, shard id): how checkpoint tensors map onto fused parameters.
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, scaled in the input dtype (as transformers does)."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary(nn.Module):
    """Default rotary embedding; cos/sin are computed from positions in fp32 (capturable in a graph)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class KVCache:
    """Static per-layer K/V tensors of shape (max_batch, local kv heads, max_seq_len, head_dim)."""

    def __init__(
        self, num_layers: int, max_batch: int, kv_heads: int, max_seq_len: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> None:
        shape = (max_batch, kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, linear_method_spec, device) -> None:
        super().__init__()
        kw = {"tp": tp, "params_dtype": cfg.dtype, "device": device}
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, linear_method=make_linear_method(linear_method_spec), **kw,
        )
        self.o_proj = RowParallelLinear(
            cfg.q_size, cfg.hidden_size, bias=False,
            linear_method=make_linear_method(linear_method_spec), **kw,
        )
        self.head_dim = cfg.head_dim
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.use_qk_norm = cfg.arch in ("qwen3", "qwen3_moe")
        if self.use_qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=cfg.dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=cfg.dtype, device=device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        c, s = cos[:, None], sin[:, None]
        q = q * c + _rotate_half(q) * s
        k = k * c + _rotate_half(k) * s
        if cache is not None:
            kc, vc = cache
            if slots is None:  # prefill: slots 0..t-1 of the first b rows
                kc[:b, :, :t].copy_(k)
                vc[:b, :, :t].copy_(v)
                k, v = kc[:b, :, :t], vc[:b, :, :t]
            else:  # decode: one slot for every row, chosen by a device tensor (graph-capturable)
                kc.index_copy_(2, slots, k)
                vc.index_copy_(2, slots, v)
                k, v = kc, vc
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, linear_method_spec, device) -> None:
        super().__init__()
        kw = {"tp": tp, "params_dtype": cfg.dtype, "device": device, "bias": False}
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2,
            linear_method=make_linear_method(linear_method_spec), **kw,
        )
        self.down_proj = RowParallelLinear(
            cfg.intermediate_size, cfg.hidden_size,
            linear_method=make_linear_method(linear_method_spec), **kw,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPInfo, linear_method_spec, device, index: int, expert_parallel: bool
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype, device=device)
        self.self_attn = Attention(cfg, tp, linear_method_spec, device)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype, device=device
        )
        self.mlp: nn.Module
        if cfg.is_moe_layer(index):
            self.mlp = SparseMoeBlock(cfg, tp, linear_method_spec, device, expert_parallel=expert_parallel)
        else:
            self.mlp = MLP(cfg, tp, linear_method_spec, device)

    def forward(self, x, cos, sin, mask, cache, slots):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: TPInfo, linear_method_spec, device, expert_parallel: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp=tp, params_dtype=cfg.dtype, device=device
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, linear_method_spec, device, i, expert_parallel)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.dtype, device=device)
        self.rotary_emb = Rotary(cfg.head_dim, cfg.rope_theta, device)


class CausalLM(nn.Module):
    """The reference decoder: ``model.*`` plus ``lm_head`` (shared with the embedding when tied).

    ``expert_parallel``: MoE experts are split over the TP group's ranks as whole experts instead of
    each expert's intermediate width (vLLM's ``enable_expert_parallel``); attention stays tensor parallel.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        tp: TPInfo | None = None,
        quantization: object = None,
        device: torch.device | str = "cpu",
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp = tp or TPInfo()
        config.check_tp(tp.size, expert_parallel=expert_parallel)
        self.config = config
        self.tp = tp
        self.expert_parallel = expert_parallel
        self.model = DecoderModel(config, tp, quantization, device, expert_parallel)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp=tp, params_dtype=config.dtype, device=device
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: KVCache | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, shape (batch, tokens, hidden)."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            layer_cache = None if cache is None else (cache.k[i], cache.v[i])
            h = layer(h, cos, sin, mask, layer_cache, slots)
        return self.model.norm(h)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads held by this rank (whole heads; replicated when there are fewer heads than ranks)."""
        attn = self.model.layers[0].self_attn
        assert isinstance(attn, Attention)
        return attn.num_kv_heads

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint-format (name, tensor) pairs through the parameters' weight loaders.

        Returns the names of the parameters written (or skipped: another rank's experts under expert
        parallelism). Unknown names (an expert id past ``num_experts`` included) raise
        UnknownTensorError; a tensor of the wrong shape or an integer tensor for a float weight raises
        LayoutMismatchError naming it. Expert keys go to ``mlp.experts.w13_weight`` / ``w2_weight`` as
        ``weight_loader(param, tensor, param_name, shard_id=, expert_id=)`` (vLLM's FusedMoE loader).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue  # derived from the config, never loaded
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # the head *is* the embedding
            expert = expert_target(name, self.config.num_experts) if self.config.num_experts else None
            if expert is not None:
                target, expert_id, moe_shard = expert
                param = params.get(target)
                if param is None:
                    raise UnknownTensorError(
                        f"{name}: the model has no experts for this checkpoint tensor (looked for "
                        f"{target!r}; layers in mlp_only_layers or off decoder_sparse_step are dense)"
                    )
                try:
                    param.weight_loader(  # type: ignore[attr-defined]
                        param, tensor, target, shard_id=moe_shard, expert_id=expert_id
                    )
                except LayoutMismatchError as e:
                    raise LayoutMismatchError(f"{name}: {e}") from None
                loaded.add(target)
                continue
            target, shard_id = name, None
            for fused, part, sid in STACKED_PARAMS:
                if f".{part}." in name:
                    target, shard_id = name.replace(f".{part}.", f".{fused}."), sid
                    break
            param = params.get(target)
            if param is None:
                raise UnknownTensorError(
                    f"{name}: the model has no parameter for this checkpoint tensor "
                    f"(looked for {target!r})"
                )
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is None:
                    default_weight_loader(param, tensor)
                elif shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
            except LayoutMismatchError as e:
                raise LayoutMismatchError(f"{name}: {e}") from None
            loaded.add(target)
        return loaded
