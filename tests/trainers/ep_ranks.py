"""Functions run on spawned expert-parallel trainer ranks: each rank's own WeightSender over gloo."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainers.expert_parallel import EXPERT_NAME, ExpertParallelSource
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.transport import TransportConfig, WeightSender

NUM_EXPERTS = 8


def _own(rank: int, ep_size: int) -> range:
    per = NUM_EXPERTS // ep_size
    return range(rank * per, (rank + 1) * per)


def stacked_model(ckpt: str, rank: int, ep_size: int) -> nn.Module:
    """A transformers-5 Qwen3-MoE holding only this rank's experts (stacked ``[E_local, ...]``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    own = _own(rank, ep_size)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(experts, name)
            setattr(experts, name, nn.Parameter(whole.detach()[own.start : own.stop].clone()))
    return model


class _Holder(nn.Module):
    pass


def module_model(ckpt: str, rank: int, ep_size: int) -> nn.Module:
    """A module tree with per-expert HF names, this rank's experts numbered from 0 (and the rest)."""
    own = _own(rank, ep_size)
    root = _Holder()
    for name, t in iter_checkpoint(ckpt):
        m = EXPERT_NAME.match(name)
        if m is not None:
            if int(m.group("e")) not in own:
                continue
            name = f"{m.group('pre')}{int(m.group('e')) - own.start}{m.group('post')}"
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, _Holder())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(t.clone(), requires_grad=False))
    return root


BAD_EXPERT = "model.layers.1.mlp.experts.5.up_proj.weight"


def send_own_part(conn: Any, rank: int, ep_size: int, ckpt: str, layout: str, bad: bool = False) -> None:
    """Build this rank's part, send it in one update, report what was sent (or the error) through ``conn``.

    bad: rank 1 holds expert 5's up projection with a wrong shape (its local expert 1)."""
    model = (stacked_model if layout == "stacked" else module_model)(ckpt, rank, ep_size)
    if bad and rank == 1:
        up = model.get_submodule("model.layers.1.mlp.experts.1.up_proj")
        up.weight = nn.Parameter(up.weight.detach()[:, :100].clone(), requires_grad=False)
    source = ExpertParallelSource(model, ep_rank=rank, ep_size=ep_size, num_experts=NUM_EXPERTS)
    manifest = source.manifest()
    sender = WeightSender(TransportConfig(backend="gloo", bucket_bytes=32 << 10, timeout_s=60.0), num_receivers=1)
    conn.send(sender.address)
    sender.connect()
    try:
        report = sender.send(source, manifest, version="b")
    except Exception as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
    else:
        conn.send({"names": list(manifest.names), "num_bytes": report.num_bytes, "source_bytes": source.num_bytes})
    sender.close()
