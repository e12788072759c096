"""Weight sources: what a trainer sends, as a manifest (metadata only) plus (name, tensor) in its order.

A source has ``manifest(version=None)``, built from parameter metadata without materializing anything
(meta tensors and DTensors work), and iterates ``(engine_name, tensor)`` in exactly that order: blocks
complete and in forward order, as the transport's protocol requires. ``ModuleSource`` covers any
``nn.Module`` or Hugging Face model, merging peft-style LoRA adapters on the fly and mapping names;
``CheckpointSource`` streams a safetensors checkpoint (mapped, in block order).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from trainers.lora import LoraFactor, find_lora_layers, merge_lora
from trainers.names import NameMap, strip_wrappers
from weight_sync.errors import ConfigError
from weight_sync.layers import order_by_block
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.safetensors_io import checkpoint_files, iter_checkpoint, read_header

__all__ = ["CheckpointSource", "ModuleSource", "SourceEntry", "split_stacked_experts"]


@dataclass(frozen=True, slots=True)
class SourceEntry:
    """One tensor a source sends: engine name, the trainer tensor, LoRA factors merged into it."""

    name: str
    trainer_name: str
    tensor: torch.Tensor
    factors: tuple[LoraFactor, ...] = ()


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (shared ones once) and persistent buffers in module registration order."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + n, p))
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((prefix + n, b))
    return out


#: Stacked experts as transformers 5 names them: ``...mlp.experts.gate_up_proj`` / ``...mlp.experts.down_proj``.
STACKED_EXPERTS = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def split_stacked_experts(entries: list[SourceEntry], offset: int = 0) -> list[SourceEntry]:
    """Replace stacked expert tensors by per-expert HF-named views (global id = local id + offset).

    transformers 5 holds a MoE layer's experts as ``experts.gate_up_proj [E, 2I, H]`` (gate rows
    first) and ``experts.down_proj [E, H, I]``; checkpoints and engines name them per expert
    (``experts.{e}.{gate,up,down}_proj.weight``). The views cost no copy; they are emitted expert by
    expert (gate, up, down) at the place of the layer's first stacked tensor, so an engine completes
    one expert before the next opens. DTensor experts are left stacked (slicing one would gather it).
    """
    stacked: dict[str, dict[str, SourceEntry]] = {}
    for e in entries:
        m = STACKED_EXPERTS.match(e.name)
        if m is not None and not _is_dtensor(e.tensor):
            if e.factors:
                raise ConfigError(f"{e.name}: LoRA adapters on stacked experts are not supported")
            stacked.setdefault(m.group("pre"), {})[m.group("kind")] = e
    out: list[SourceEntry] = []
    done: set[str] = set()
    for e in entries:
        m = STACKED_EXPERTS.match(e.name)
        if m is None or _is_dtensor(e.tensor):
            out.append(e)
            continue
        pre = m.group("pre")
        if pre in done:
            continue  # this layer's experts are already out
        done.add(pre)
        kinds = stacked[pre]
        if set(kinds) != {"gate_up_proj", "down_proj"}:
            raise ConfigError(f"{pre}: stacked experts need gate_up_proj and down_proj, got {sorted(kinds)}")
        # Views of detached aliases: no autograd history, and the trainer's later in-place steps show.
        gate_up, down = kinds["gate_up_proj"].tensor.detach(), kinds["down_proj"].tensor.detach()
        num, two_i = gate_up.shape[0], gate_up.shape[1] if gate_up.dim() > 1 else 0
        if gate_up.dim() != 3 or down.dim() != 3 or down.shape[0] != num or two_i % 2 or down.shape[2] != two_i // 2:
            raise ConfigError(
                f"{pre}: stacked experts expect gate_up_proj [E, 2I, H] and down_proj [E, H, I], got "
                f"{tuple(gate_up.shape)} and {tuple(down.shape)}"
            )
        i = two_i // 2
        for j in range(num):
            g = offset + j
            out += [SourceEntry(f"{pre}.{g}.gate_proj.weight", kinds["gate_up_proj"].trainer_name, gate_up[j, :i]),
                    SourceEntry(f"{pre}.{g}.up_proj.weight", kinds["gate_up_proj"].trainer_name, gate_up[j, i:]),
                    SourceEntry(f"{pre}.{g}.down_proj.weight", kinds["down_proj"].trainer_name, down[j])]
    return out


def plan_entries(model: nn.Module, name_map: NameMap | None, expert_offset: int = 0) -> list[SourceEntry]:
    """The tensors ``model`` sends, LoRA-merged and renamed, in block order of the engine names
    (stacked experts split per expert, see :func:`split_stacked_experts`)."""
    name_map = name_map or NameMap()
    lora = find_lora_layers(model)
    skip: set[str] = {n for spec in lora.values() for n in spec.adapter_param_names}
    factors_of: dict[str, tuple[LoraFactor, ...]] = {}
    rename: dict[str, str] = {}
    for path, spec in lora.items():
        base_name = f"{path}.base_layer.weight" if path else "base_layer.weight"
        factors_of[base_name] = spec.factors
        rename[base_name] = f"{path}.weight" if path else "weight"
    named = []
    for raw_name, t in _named_tensors(model):
        if raw_name in skip:
            continue
        name = rename.get(raw_name, raw_name).replace(".base_layer.", ".")
        named.append((raw_name, strip_wrappers(name), t))
    mapped = dict(name_map.map_all(n for _, n, _ in named))
    entries = [
        SourceEntry(mapped[n], raw, t, factors_of.get(raw, ()))
        for raw, n, t in named
        if n in mapped
    ]
    module_order = [e.name for e in entries]
    order = order_by_block(module_order, reference_order=module_order)
    by_name = {e.name: e for e in entries}
    return split_stacked_experts([by_name[n] for n in order], expert_offset)


class ModuleSource:
    """Send an ``nn.Module``'s (or an HF model's) weights: ``ModuleSource(model, name_map=None)``.

    dtype: cast every floating-point tensor on the fly (e.g. fp32 master weights -> bf16 on the wire).
    LoRA adapters (peft layout) are merged into their base weights as they are sent. Stacked experts
    (transformers 5 MoE models) are sent per expert under the checkpoint's names; ``expert_offset`` is
    the global id of the model's first expert (an expert-parallel rank's part, see
    :class:`trainers.expert_parallel.ExpertParallelSource`).
    """

    def __init__(self, model: nn.Module, name_map: NameMap | None = None, *, dtype: torch.dtype | None = None,
                 expert_offset: int = 0) -> None:
        self.model = model
        self.dtype = dtype
        self.entries = plan_entries(model, name_map, expert_offset)

    def _dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.dtype.is_floating_point else t.dtype

    def manifest(self, version: Any = None) -> Manifest:
        """Names, dtypes and global shapes, from metadata only."""
        return Manifest(tuple(TensorMeta(e.name, self._dtype(e.tensor), tuple(e.tensor.shape)) for e in self.entries),
                        version=version)

    def materialize(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    def produce(self, entry: SourceEntry) -> torch.Tensor:
        t = self.materialize(entry.tensor)
        if entry.factors:
            t = merge_lora(t, entry.factors, self.materialize)
        dtype = self._dtype(t)
        return t if t.dtype == dtype else t.to(dtype)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for e in self.entries:
                yield e.name, self.produce(e)


class CheckpointSource:
    """Send a safetensors checkpoint (file or directory), mapped zero-copy, in block order."""

    def __init__(self, path: str | os.PathLike, name_map: NameMap | None = None) -> None:
        self.path = path
        metas: dict[str, TensorMeta] = {}
        for f in checkpoint_files(path):
            for e in read_header(f).values():
                metas[e.name] = TensorMeta(e.name, e.dtype, e.shape)
        order = order_by_block(metas)
        self._map = dict((name_map or NameMap()).map_all(order))
        self._metas = [TensorMeta(self._map[n], metas[n].dtype, metas[n].shape) for n in order if n in self._map]

    def manifest(self, version: Any = None) -> Manifest:
        return Manifest(tuple(self._metas), version=version)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in iter_checkpoint(self.path):
            if n in self._map:
                yield self._map[n], t
