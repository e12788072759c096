"""TP=2 over gloo: reload equals a fresh TP=2 load, and per-tensor fp8 scales agree across ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from weight_sync.engine import ReferenceEngine
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal, run_distributed


def _reload_vs_fresh(rank: int, world: int, a: str, b: str, quant: str | None) -> dict:
    group = dist.group.WORLD
    engine = ReferenceEngine.from_checkpoint(a, quantization=quant, tp_group=group)
    engine.reload_weights(weights_iterator=reversed(list(iter_checkpoint(b))))
    fresh = ReferenceEngine.from_checkpoint(b, quantization=quant, tp_group=group)
    assert_bitwise_equal(engine.model, fresh.model)
    scale = engine.model.model.layers[0].self_attn.qkv_proj.__dict__.get("_parameters", {}).get("weight_scale")
    return {"tokens": engine.generate([[5, 6, 7]], 5), "scale": None if scale is None else scale.clone()}


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_tp2_reload_equals_fresh_tp2(quant, qwen3_a: Path, qwen3_b: Path) -> None:
    r0, r1 = run_distributed(_reload_vs_fresh, 2, str(qwen3_a), str(qwen3_b), quant)
    assert r0["tokens"] == r1["tokens"]
    if quant == "fp8":
        assert torch.equal(r0["scale"], r1["scale"])  # MAX-reduced per-tensor scale
