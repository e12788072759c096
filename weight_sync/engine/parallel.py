"""Tensor-parallel layers with vLLM's loading convention.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``, a bound method of its layer
that narrows the checkpoint tensor to this rank's shard and copies it into the right slice of the (fused)
parameter. Column-parallel layers split output rows, row-parallel layers split input columns and all-reduce,
the vocab-parallel embedding splits (padded) vocabulary rows. GQA: when there are fewer KV heads than
ranks, KV heads are replicated so that every rank holds whole heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from weight_sync.errors import LayoutMismatchError
from weight_sync.layers.loading import check_loadable
from weight_sync.layers.loading import describe as _shape
from weight_sync.quant.base import LinearMethod, UnquantizedLinearMethod, make_weight_param

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
    "TPInfo",
    "VocabParallelEmbedding",
]


@dataclass(frozen=True, slots=True)
class TPInfo:
    """A tensor-parallel group and this process's place in it (group None: one rank)."""

    group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def _narrow_rows(loaded: torch.Tensor, start: int, size: int, what: str) -> torch.Tensor:
    if loaded.dim() < 1 or start + size > loaded.shape[0]:
        raise LayoutMismatchError(
            f"{what}expects at least {start + size} rows to take rows {start}..{start + size}, "
            f"got {_shape(loaded)}"
        )
    return loaded.narrow(0, start, size)


class LinearBase(nn.Module):
    """Holds a linear method and the TP info; subclasses define partition sizes and loaders."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        tp: TPInfo,
        bias: bool,
        params_dtype: torch.dtype,
        linear_method: LinearMethod | None,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp = tp
        self.tp_group = tp.group
        self.quant_method = linear_method or UnquantizedLinearMethod()
        if self.quant_method.processor_reads_input:
            # Declares to reload that this layer can be processed from the caller's memory.
            self.ws_processor_reads_input = True
        self.params_dtype = params_dtype
        self._device = device
        self._has_bias = bias

    def _create(self, in_per_part: int, out_parts: list[int]) -> None:
        self.quant_method.create_weights(
            self,
            input_size_per_partition=in_per_part,
            output_partition_sizes=out_parts,
            params_dtype=self.params_dtype,
            weight_loader=self.weight_loader,
            device=self._device,
        )
        if self._has_bias:
            self.register_parameter(
                "bias",
                make_weight_param((sum(out_parts),), self.params_dtype, self._device,
                                  self.weight_loader, output_dim=0),
            )
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self._bias())

    def _bias(self) -> torch.Tensor | None:
        b = self._parameters.get("bias")
        return None if b is None else b


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (an MoE router); the output needs no collective."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, **kw)
        self._create(input_size, [output_size])

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        check_loadable(param, loaded)
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output rows split over ranks; ``gather_output`` all-gathers them back."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, **kw)
        if output_size % self.tp.size:
            raise LayoutMismatchError(f"output size {output_size} not divisible by TP size {self.tp.size}")
        self.output_size_per_partition = output_size // self.tp.size
        self._create(input_size, self.output_partition_sizes())

    def output_partition_sizes(self) -> list[int]:
        return [self.output_size_per_partition]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        rows = param.shape[0]
        shard = _narrow_rows(loaded, self.tp.rank * rows, rows, "")
        check_loadable(param, shard)
        param.data.copy_(shard)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused (gate/up -> gate_up); ``shard_id`` is the part index."""

    def __init__(self, input_size: int, output_sizes: list[int], **kw) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), **kw)

    def output_partition_sizes(self) -> list[int]:
        return [s // self.tp.size for s in self.output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise LayoutMismatchError(
                f"shard id must be an int in [0, {len(self.output_sizes)}), got {shard_id!r}"
            )
        parts = self.output_partition_sizes()
        size = parts[shard_id]
        offset = sum(parts[:shard_id])
        full = self.output_sizes[shard_id]
        if loaded.dim() < 1 or loaded.shape[0] != full:
            raise LayoutMismatchError(
                f"shard {shard_id} expects {full} rows (x {tuple(param.shape[1:])}), got {_shape(loaded)}"
            )
        dest = param.data.narrow(0, offset, size)
        src = loaded.narrow(0, self.tp.rank * size, size)
        check_loadable(dest, src)
        dest.copy_(src)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard ids 'q', 'k', 'v'. KV heads are replicated when kv_heads < tp."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kw
    ) -> None:
        tp: TPInfo = kw["tp"]
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            self.num_kv_heads = num_kv_heads // tp.size
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = tp.size // num_kv_heads
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, out, **kw)

    def output_partition_sizes(self) -> list[int]:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return [q, kv, kv]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        q, kv, _ = self.output_partition_sizes()
        if shard_id == "q":
            offset, size, src_start, full = 0, q, self.tp.rank * q, self.total_num_heads * self.head_dim
        elif shard_id in ("k", "v"):
            kv_rank = self.tp.rank // self.kv_replicas
            offset = q if shard_id == "k" else q + kv
            size, src_start, full = kv, kv_rank * kv, self.total_num_kv_heads * self.head_dim
        else:
            raise LayoutMismatchError(f"shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        if loaded.dim() < 1 or loaded.shape[0] != full:
            raise LayoutMismatchError(
                f"shard {shard_id!r} expects {full} rows (x {tuple(param.shape[1:])}), got {_shape(loaded)}"
            )
        dest = param.data.narrow(0, offset, size)
        src = loaded.narrow(0, src_start, size)
        check_loadable(dest, src)
        dest.copy_(src)


class RowParallelLinear(LinearBase):
    """Input columns split over ranks; partial outputs are all-reduced (bias added once, after)."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, output_size, **kw)
        if input_size % self.tp.size:
            raise LayoutMismatchError(f"input size {input_size} not divisible by TP size {self.tp.size}")
        self.input_size_per_partition = input_size // self.tp.size
        self._create(self.input_size_per_partition, [output_size])

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 2:
            cols = param.shape[1]
            if loaded.dim() != 2 or loaded.shape[1] != cols * self.tp.size:
                raise LayoutMismatchError(
                    f"expects ({param.shape[0]}, {cols * self.tp.size}), got {_shape(loaded)}"
                )
            loaded = loaded.narrow(1, self.tp.rank * cols, cols)
        check_loadable(param, loaded)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, None)
        out = self.tp.all_reduce(out)
        bias = self._bias()
        return out if bias is None else out + bias


def pad_vocab(vocab_size: int, tp_size: int, multiple: int = 64) -> int:
    """Vocabulary padded so that every rank holds the same number of rows (a multiple of 64)."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks; the padding rows past ``vocab_size`` stay zero."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, tp: TPInfo, params_dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_vocab(vocab_size, tp.size)
        self.rows_per_rank = self.padded_vocab_size // tp.size
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = self.vocab_start + self.rows_per_rank
        self.weight = make_weight_param(
            (self.rows_per_rank, hidden_size), params_dtype, device, self.weight_loader, output_dim=0
        )

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise LayoutMismatchError(
                f"expects ({self.vocab_size}, {param.shape[1]}), got {_shape(loaded)}"
            )
        start = min(self.vocab_start, self.vocab_size)
        n = max(0, min(self.vocab_end, self.vocab_size) - start)
        src = loaded.narrow(0, start, n)
        check_loadable(param.data.narrow(0, 0, n), src)
        param.data.narrow(0, 0, n).copy_(src)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mask, ids - self.vocab_start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over the vocab-parallel rows; logits are gathered and cut to ``vocab_size``."""

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight)
        full = self.tp.all_gather_last_dim(local)
        return full[..., : self.vocab_size]
