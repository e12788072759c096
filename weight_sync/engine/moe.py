"""Qwen3-MoE sparse blocks with vLLM's fused-experts layout and expert loader convention.

A block is a replicated router (``mlp.gate``, never quantized) and a :class:`FusedMoE` experts layer
(``mlp.experts``) holding every local expert stacked: ``w13_weight [E_local, 2I, H]`` (per expert, gate
rows then up rows) and ``w2_weight [E_local, H, I]``. Checkpoint keys
``mlp.experts.{e}.{gate,up,down}_proj.weight`` reach them through
``weight_loader(param, loaded_weight, weight_name, shard_id, expert_id)`` with shard ids ``w1`` (gate),
``w3`` (up) and ``w2`` (down), as :func:`make_expert_params_mapping` maps them (vLLM's
``FusedMoE.make_expert_params_mapping``).

Parallelism over the engine's TP group: by default every rank holds every expert with its intermediate
width split (w13 column-split per expert, w2 row-split); with ``expert_parallel`` every rank holds
``E / size`` whole experts (rank r: experts ``r * E/size ..``) and ignores the keys of the others. Both
produce partial sums over the hidden size that are all-reduced after the experts.

Routing follows transformers' ``Qwen3MoeSparseMoeBlock``: softmax in fp32, top-k, renormalized when
``norm_topk_prob``, cast back to the hidden dtype; each expert's output is scaled by its weight and added
into the result in ascending expert order.
"""

from __future__ import annotations

import re
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from weight_sync.engine.config import ModelConfig
from weight_sync.engine.parallel import ReplicatedLinear, TPInfo
from weight_sync.errors import LayoutMismatchError, UnknownTensorError
from weight_sync.layers.loading import check_loadable
from weight_sync.layers.loading import describe as _shape
from weight_sync.quant.moe import FusedMoEMethod, make_moe_method

__all__ = [
    "EXPERT_KEY",
    "FusedMoE",
    "SparseMoeBlock",
    "expert_target",
    "make_expert_params_mapping",
    "select_experts",
]

#: A checkpoint expert key: ``<prefix>.mlp.experts.<id>.<gate_proj|up_proj|down_proj>.weight``.
EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.mlp\.)(?P<frag>experts\.(?P<id>\d+)\.(?P<proj>\w+)\.)weight$")
SHARD_IDS = ("w1", "w2", "w3")


def make_expert_params_mapping(
    ckpt_gate_proj_name: str, ckpt_down_proj_name: str, ckpt_up_proj_name: str, num_experts: int
) -> list[tuple[str, str, int, str]]:
    """(param_name, weight_name, expert_id, shard_id) for every expert, as vLLM's FusedMoE makes it.

    ``weight_name`` is the checkpoint fragment (``experts.3.gate_proj.``), ``param_name`` what replaces it
    (``experts.w13_``): ``...mlp.experts.3.gate_proj.weight`` -> ``...mlp.experts.w13_weight``, shard w1.
    """
    return [
        (
            "experts.w13_" if weight_name in (ckpt_gate_proj_name, ckpt_up_proj_name) else "experts.w2_",
            f"experts.{expert_id}.{weight_name}.",
            expert_id,
            shard_id,
        )
        for expert_id in range(num_experts)
        for shard_id, weight_name in (
            ("w1", ckpt_gate_proj_name), ("w2", ckpt_down_proj_name), ("w3", ckpt_up_proj_name),
        )
    ]


@lru_cache(maxsize=8)
def _mapping_by_fragment(num_experts: int) -> dict[str, tuple[str, int, str]]:
    # The list is scanned once per model shape, not once per key (18k expert keys at 30B-A3B).
    return {
        frag: (param, expert, shard)
        for param, frag, expert, shard in make_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", num_experts
        )
    }


def expert_target(name: str, num_experts: int) -> tuple[str, int, str] | None:
    """(parameter name, expert id, shard id) of checkpoint expert key ``name``; None if it is none.

    Raises UnknownTensorError naming the key when it has the form of an expert key but no mapping (an
    expert id >= ``num_experts``, an unknown projection).
    """
    m = EXPERT_KEY.match(name)
    if m is None:
        return None
    hit = _mapping_by_fragment(num_experts).get(m["frag"])
    if hit is None:
        raise UnknownTensorError(
            f"{name}: no expert parameter for this key: the model has {num_experts} experts "
            f"(ids 0..{num_experts - 1}) with gate_proj, up_proj and down_proj; got expert "
            f"{m['id']} {m['proj']}"
        )
    param, expert, shard = hit
    return m["prefix"] + param + "weight", expert, shard


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k]): transformers' Qwen3MoeTopKRouter."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


class FusedMoE(nn.Module):
    """Stacked experts of one sparse block (vLLM's FusedMoE layout); ``quant_method`` processes them."""

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPInfo,
        expert_parallel: bool,
        params_dtype: torch.dtype,
        quant_method: FusedMoEMethod,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.global_num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.use_ep = expert_parallel and tp.size > 1
        # Under EP an expert is whole on one rank; otherwise every rank holds 1/size of every expert.
        self.ep_size, self.ep_rank = (tp.size, tp.rank) if self.use_ep else (1, 0)
        self.moe_tp_size, self.moe_tp_rank = (1, 0) if self.use_ep else (tp.size, tp.rank)
        if num_experts % self.ep_size or intermediate_size % self.moe_tp_size:
            raise LayoutMismatchError(
                f"{num_experts} experts of width {intermediate_size} cannot be split over "
                f"{self.ep_size} expert-parallel x {self.moe_tp_size} tensor-parallel ranks"
            )
        self.local_num_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.local_num_experts
        self.intermediate_size_per_partition = intermediate_size // self.moe_tp_size
        # The group whose ranks hold parts of the same expert: per-tensor fp8 scales are MAX-reduced
        # over it so that every part is quantized with the scale of the whole expert.
        self.moe_tp_group = tp.group if self.moe_tp_size > 1 else None
        self.quant_method = quant_method
        quant_method.create_weights(
            self,
            num_experts=self.local_num_experts,
            hidden_size=hidden_size,
            intermediate_size_per_partition=self.intermediate_size_per_partition,
            params_dtype=params_dtype,
            weight_loader=self.weight_loader,
            device=device,
        )

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, weight_name: str, shard_id: str,
        expert_id: int,
    ) -> None:
        """Copy one expert's gate (w1), up (w3) or down (w2) projection into this rank's slice.

        ``expert_id`` is global. Shapes are checked on every rank before a non-local expert is skipped,
        so that all ranks refuse the same bad tensor.
        """
        if shard_id not in SHARD_IDS:
            raise LayoutMismatchError(f"{weight_name}: shard id must be 'w1', 'w2' or 'w3', got {shard_id!r}")
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.global_num_experts:
            raise UnknownTensorError(
                f"{weight_name}: expert id must be in [0, {self.global_num_experts}), got {expert_id!r}"
            )
        i, h = self.intermediate_size, self.hidden_size
        full = (h, i) if shard_id == "w2" else (i, h)
        if tuple(loaded_weight.shape) != full:
            raise LayoutMismatchError(
                f"expert {expert_id} shard {shard_id!r} expects {full}, got {_shape(loaded_weight)}"
            )
        local = expert_id - self.expert_start
        if not 0 <= local < self.local_num_experts:
            return  # another rank's expert (expert parallel)
        part = self.intermediate_size_per_partition
        start = self.moe_tp_rank * part
        if shard_id == "w2":  # row-parallel: this rank's input columns
            dest, src = param.data[local], loaded_weight.narrow(1, start, part)
        else:  # column-parallel: this rank's rows, into the gate (first) or up (second) half
            dest = param.data[local].narrow(0, 0 if shard_id == "w1" else part, part)
            src = loaded_weight.narrow(0, start, part)
        check_loadable(dest, src, f"expert {expert_id} shard {shard_id!r} ")
        dest.copy_(src)

    def _expert(self, x: torch.Tensor, local: int) -> torch.Tensor:
        w13, w2 = self.quant_method.expert_weights(self, local, x.dtype)
        gate, up = F.linear(x, w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over its experts for tokens ``x [T, H]`` (all-reduce it after)."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_dense(x, topk_weights, topk_ids)
        out = torch.zeros_like(x)
        with torch.no_grad():
            mask = F.one_hot(topk_ids, num_classes=self.global_num_experts).permute(2, 1, 0)  # [E, k, T]
            hit = mask.sum(dim=(-1, -2)).nonzero().flatten().tolist()  # the one host sync per layer
        end = self.expert_start + self.local_num_experts
        for e in hit:
            if not self.expert_start <= e < end:
                continue
            pos, tok = torch.where(mask[e])
            y = self._expert(x[tok], e - self.expert_start) * topk_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def forward_dense(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`forward` without data-dependent shapes or host syncs (capturable in a CUDA graph).

        Every local expert runs on every token, scaled by its routing weight (zero when not chosen), added
        in the same ascending order. Equal to :meth:`forward` up to the matmul's rounding, which may depend
        on the number of rows; it costs ``E_local / top_k`` times the expert compute (decode batches only).
        """
        out = torch.zeros_like(x)
        for local in range(self.local_num_experts):
            e = self.expert_start + local
            w = (topk_weights * (topk_ids == e)).sum(dim=-1, keepdim=True)
            out += self._expert(x, local) * w
        return out


class SparseMoeBlock(nn.Module):
    """Router + experts of one Qwen3-MoE layer; ``gate`` and ``experts`` as HF and vLLM name them."""

    def __init__(
        self, cfg: ModelConfig, tp: TPInfo, quantization: object, device: torch.device | str, *,
        expert_parallel: bool,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        # The router stays in the model dtype on every rank (vLLM never quantizes it either).
        self.gate = ReplicatedLinear(
            cfg.hidden_size, cfg.num_experts, tp=tp, bias=False, params_dtype=cfg.dtype,
            linear_method=None, device=device,
        )
        self.experts = FusedMoE(
            num_experts=cfg.num_experts, hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size, tp=tp, expert_parallel=expert_parallel,
            params_dtype=cfg.dtype, quant_method=make_moe_method(quantization), device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        weights, ids = select_experts(self.gate(h), self.top_k, self.renormalize)
        out = self.tp.all_reduce(self.experts(h, weights, ids))
        return out.reshape(shape)
