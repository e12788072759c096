"""The reference engine's needs computed from its config: TP/EP shard boxes without building a model.

:func:`reference_engine_needs` says, for every checkpoint tensor, which box each rank of each engine
replica needs and where it lands in the rank's (fused) parameter, following the loaders of
:mod:`weight_sync.engine.parallel` and :mod:`weight_sync.engine.moe`: q/k/v rows into ``qkv_proj`` (KV
heads replicated when there are fewer than ranks), gate/up rows into ``gate_up_proj``, columns of
``o_proj`` / ``down_proj``, vocabulary rows of the (padded) embedding and head, whole norms and routers,
experts split inside (TP) or whole on one rank (EP). It allocates nothing, so it serves simulations at
trillion-parameter shapes; tests hold it equal to the needs recorded from real engines' reload plans
(:func:`~weight_sync.transport.routes_layouts.needs_from_model`).

Limitations: unquantized layers only (online quantization keeps the same model-format boxes but is not
checked here); no shared experts; no MLA.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from weight_sync.engine.config import ModelConfig
from weight_sync.engine.moe import EXPERT_KEY
from weight_sync.engine.parallel import pad_vocab
from weight_sync.errors import ConfigError, UnknownTensorError
from weight_sync.manifest import TensorMeta
from weight_sync.transport.routes import Box, Need, NeedPiece

__all__ = ["reference_checkpoint_metas", "reference_engine_needs"]

# (checkpoint fragment, fused parameter fragment, kind) for the dense projections.
_FUSED = (
    ("self_attn.q_proj.", "self_attn.qkv_proj.", "q"),
    ("self_attn.k_proj.", "self_attn.qkv_proj.", "k"),
    ("self_attn.v_proj.", "self_attn.qkv_proj.", "v"),
    ("mlp.gate_proj.", "mlp.gate_up_proj.", "gate"),
    ("mlp.up_proj.", "mlp.gate_up_proj.", "up"),
    ("self_attn.o_proj.", "self_attn.o_proj.", "cols"),
    ("mlp.down_proj.", "mlp.down_proj.", "cols"),
)

_Got = tuple[Box, int, tuple[int, ...]] | None  # (box, destination offset, destination stride)


def _rows(shape: tuple[int, ...], start: int, n: int, dst_row: int) -> _Got:
    """Rows ``start..start+n`` of a (rows[, cols]) tensor into row ``dst_row`` of a contiguous param."""
    if n <= 0:
        return None
    if len(shape) == 1:
        return ((start, start + n),), dst_row, (1,)
    cols = shape[1]
    return ((start, start + n), (0, cols)), dst_row * cols, (cols, 1)


def _one(kind: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int, t: int, ep: bool,
         expert: int, proj: str) -> _Got:
    """What TP rank ``t`` needs of one tensor of ``kind`` (None: nothing)."""
    if kind == "whole":
        box = tuple((0, n) for n in shape)
        stride = (shape[1], 1) if len(shape) == 2 else (1,)
        return box, 0, stride
    if kind == "vocab":  # VocabParallelEmbedding / ParallelLMHead: padded rows per rank
        per = pad_vocab(cfg.vocab_size, tp) // tp
        start = min(t * per, cfg.vocab_size)
        return _rows(shape, start, min(t * per + per, cfg.vocab_size) - start, 0)
    if kind in ("q", "k", "v"):
        q = cfg.q_size // tp
        if cfg.num_key_value_heads >= tp:
            kv, kv_rank = cfg.kv_size // tp, t
        else:
            kv, kv_rank = cfg.head_dim, t // (tp // cfg.num_key_value_heads)
        if kind == "q":
            return _rows(shape, t * q, q, 0)
        return _rows(shape, kv_rank * kv, kv, q if kind == "k" else q + kv)
    if kind in ("gate", "up"):
        i = shape[0] // tp
        return _rows(shape, t * i, i, 0 if kind == "gate" else i)
    if kind == "cols":  # row-parallel: this rank's input columns
        c = shape[1] // tp
        return ((0, shape[0]), (t * c, t * c + c)), 0, (c, 1)
    if kind == "expert":
        h, m = cfg.hidden_size, cfg.moe_intermediate_size
        if ep:
            local_n = cfg.num_experts // tp
            if expert // local_n != t:
                return None  # another rank's expert
            local, part, start = expert % local_n, m, 0
        else:
            local, part, start = expert, m // tp, t * (m // tp)
        if proj == "down_proj":  # w2 [E_local, H, I_part]: columns of the expert
            return ((0, h), (start, start + part)), local * h * part, (part, 1)
        # w13 [E_local, 2 I_part, H]: gate rows first, then up rows
        base = local * 2 * part * h + (0 if proj == "gate_proj" else part * h)
        return ((start, start + part), (0, h)), base, (h, 1)
    raise AssertionError(kind)


@lru_cache(maxsize=8192)
def _pieces(kind: str, shape: tuple[int, ...], cfg: ModelConfig, tp: int, num_engines: int,
            first_rank: int, ep: bool, expert: int, proj: str) -> tuple[NeedPiece, ...]:
    # Shared by every tensor of one pattern (all blocks' q_proj; expert e of every layer).
    out = []
    for j in range(num_engines):
        for t in range(tp):
            got = _one(kind, shape, cfg, tp, t, ep, expert, proj)
            if got is not None:
                box, off, stride = got
                out.append(NeedPiece(rank=first_rank + j * tp + t, box=box, dst_offset=off, dst_stride=stride))
    return tuple(out)


def _classify(name: str, cfg: ModelConfig) -> tuple[str, str, int, str] | None:
    """(kind, destination parameter, expert id, projection) of a checkpoint key; None: ignored."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return None  # the head *is* the embedding
        return "vocab", name, -1, ""
    m = EXPERT_KEY.match(name) if cfg.num_experts else None
    if m is not None:
        e = int(m["id"])
        proj = m["proj"]
        if e >= cfg.num_experts or proj not in ("gate_proj", "up_proj", "down_proj"):
            raise UnknownTensorError(f"{name}: the model has {cfg.num_experts} experts with gate_proj, "
                                     f"up_proj and down_proj; got expert {e} {proj}")
        param = m["prefix"] + ("experts.w2_weight" if proj == "down_proj" else "experts.w13_weight")
        return "expert", param, e, proj
    for frag, fused, kind in _FUSED:
        if frag in name:
            return kind, name.replace(frag, fused), -1, ""
    if name.endswith("norm.weight") or name.endswith("mlp.gate.weight"):
        return "whole", name, -1, ""
    raise UnknownTensorError(f"{name}: the reference engine has no parameter for this checkpoint tensor")


def reference_engine_needs(
    config: ModelConfig,
    *,
    tp_size: int,
    num_engines: int = 1,
    expert_parallel: bool = False,
    first_rank: int = 0,
    metas: list[TensorMeta] | None = None,
) -> list[Need]:
    """Needs of ``num_engines`` reference engines of ``tp_size`` ranks each, in checkpoint block order.

    Engine ``j``'s TP rank ``t`` is engine rank ``first_rank + j * tp_size + t``. ``metas`` defaults to
    :func:`reference_checkpoint_metas`; keys the engine ignores (a tied head) are left out.
    """
    if tp_size < 1 or num_engines < 1:
        raise ConfigError(f"tp_size and num_engines must be >= 1, got {tp_size} and {num_engines}")
    config.check_tp(tp_size, expert_parallel=expert_parallel)
    ep = expert_parallel and tp_size > 1
    out = []
    for m in metas if metas is not None else reference_checkpoint_metas(config):
        got = _classify(m.name, config)
        if got is None:
            continue
        kind, param, expert, proj = got
        shape = tuple(m.shape)
        pieces = _pieces(kind, shape, config, tp_size, num_engines, first_rank, ep, expert, proj)
        out.append(Need(name=m.name, shape=shape, dtype=m.dtype, param=param, pieces=pieces))
    return out


def reference_checkpoint_metas(
    config: ModelConfig, dtype: torch.dtype | None = None
) -> list[TensorMeta]:
    """Names and shapes of a checkpoint for ``config`` in block order (as ``random_weights`` yields)."""
    dt = dtype or config.dtype
    h, hd = config.hidden_size, config.head_dim
    q, kv = config.q_size, config.kv_size
    out = [TensorMeta("model.embed_tokens.weight", dt, (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out.append(TensorMeta(p + "input_layernorm.weight", dt, (h,)))
        for part, rows in (("q", q), ("k", kv), ("v", kv)):
            out.append(TensorMeta(p + f"self_attn.{part}_proj.weight", dt, (rows, h)))
        if config.attention_bias:
            for part, rows in (("q", q), ("k", kv), ("v", kv)):
                out.append(TensorMeta(p + f"self_attn.{part}_proj.bias", dt, (rows,)))
        out.append(TensorMeta(p + "self_attn.o_proj.weight", dt, (h, q)))
        if config.arch in ("qwen3", "qwen3_moe"):
            out.append(TensorMeta(p + "self_attn.q_norm.weight", dt, (hd,)))
            out.append(TensorMeta(p + "self_attn.k_norm.weight", dt, (hd,)))
        out.append(TensorMeta(p + "post_attention_layernorm.weight", dt, (h,)))
        if config.is_moe_layer(i):
            m = config.moe_intermediate_size
            out.append(TensorMeta(p + "mlp.gate.weight", dt, (config.num_experts, h)))
            for e in range(config.num_experts):
                out.append(TensorMeta(p + f"mlp.experts.{e}.gate_proj.weight", dt, (m, h)))
                out.append(TensorMeta(p + f"mlp.experts.{e}.up_proj.weight", dt, (m, h)))
                out.append(TensorMeta(p + f"mlp.experts.{e}.down_proj.weight", dt, (h, m)))
            continue
        inter = config.intermediate_size
        out.append(TensorMeta(p + "mlp.gate_proj.weight", dt, (inter, h)))
        out.append(TensorMeta(p + "mlp.up_proj.weight", dt, (inter, h)))
        out.append(TensorMeta(p + "mlp.down_proj.weight", dt, (h, inter)))
    out.append(TensorMeta("model.norm.weight", dt, (h,)))
    if not config.tie_word_embeddings:
        out.append(TensorMeta("lm_head.weight", dt, (config.vocab_size, h)))
    return out
