"""Direct ``param.weight_loader(...)`` calls between initialize and finalize are part of the reload.

Code written against vLLM's layerwise reload calls parameters' loaders itself; each call must be
validated, counted and transactional like ``model.load_weights``, never a silent write into live tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from weight_sync import (
    LayoutMismatchError,
    UnknownTensorError,
    finalize_layerwise_processing,
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)
from weight_sync.engine import ReferenceEngine
from weight_sync.engine.model import STACKED_PARAMS
from weight_sync.layers.loading import default_weight_loader
from weight_sync.reload import torn_reason
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import assert_bitwise_equal


def _load_like_vllm(model, weights, *, shard_as_keyword: bool = False) -> None:
    """What upstream code does instead of ``model.load_weights``: look parameters up, call their loaders."""
    params = dict(model.named_parameters())
    for name, tensor in weights:
        target, shard = name, None
        for fused, part, sid in STACKED_PARAMS:
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), sid
                break
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        elif shard_as_keyword:
            loader(param, tensor, shard_id=shard)
        else:
            loader(param, tensor, shard)


def _checkpoint(path: Path) -> list[tuple[str, torch.Tensor]]:
    # The engine ties nothing here, so every checkpoint tensor has its own parameter.
    return list(iter_checkpoint(path))


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("shard_as_keyword", [False, True])
def test_direct_loader_calls_reload_the_model_like_load_weights(quant, shard_as_keyword, qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization=quant)
    loaders = {n: p.__dict__.get("weight_loader") for n, p in engine.model.named_parameters()}
    items = _checkpoint(qwen3_b)
    initialize_layerwise_reload(engine.model)
    _load_like_vllm(engine.model, items, shard_as_keyword=shard_as_keyword)
    report = finalize_layerwise_processing(engine.model)
    assert report.num_tensors == len(items)  # every call was a validated, counted tensor of the update
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, quantization=quant).model)
    # The session's routing is gone with it: parameters carry the loaders they had.
    assert {n: p.__dict__.get("weight_loader") for n, p in engine.model.named_parameters()} == loaders


def test_a_direct_loader_call_of_the_wrong_shape_rolls_the_update_back(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8")
    items = _checkpoint(qwen3_b)
    k = "model.layers.0.self_attn.k_proj.weight"
    bad = [(n, torch.zeros(3, t.shape[1], dtype=t.dtype) if n == k else t) for n, t in items]
    initialize_layerwise_reload(engine.model, rollback=True)
    with pytest.raises(LayoutMismatchError, match=re.escape(k)):
        _load_like_vllm(engine.model, bad)
    assert torn_reason(engine.model) is None
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_a, quantization="fp8").model)
    initialize_layerwise_reload(engine.model)
    _load_like_vllm(engine.model, items)
    finalize_layerwise_reload(engine.model, None)  # vLLM's other name
    assert_bitwise_equal(engine.model, ReferenceEngine.from_checkpoint(qwen3_b, quantization="fp8").model)


def test_a_direct_loader_call_that_matches_no_checkpoint_tensor_is_refused_before_it_writes(qwen3_a, qwen3_b) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj.weight
    before = qkv.detach().clone()
    initialize_layerwise_reload(engine.model)
    # A whole fused tensor without a shard id: no checkpoint tensor is loaded by that call.
    with pytest.raises(UnknownTensorError, match=r"qkv_proj\.weight: weight_loader call with .*no checkpoint tensor"):
        qkv.weight_loader(qkv, torch.ones_like(qkv))
    assert torch.equal(qkv, before)
    assert torn_reason(engine.model) is None  # nothing was written, nothing is torn
    assert engine.generate([[5, 6]], 2) == ReferenceEngine.from_checkpoint(qwen3_a).generate([[5, 6]], 2)
