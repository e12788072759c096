"""RegionSink: regions of checkpoint tensors written into an open update session equal whole-tensor loads,
for direct layers (straight into live tensors), processed layers (fp8: own-shard staging, processed when
the last region lands) and MoE experts processed unit by unit - in any order across senders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transport._routes_ranks import FixedTP
from weight_sync.engine import ReferenceEngine
from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM
from weight_sync.errors import LayoutMismatchError, UpdateStateError
from weight_sync.manifest import Manifest
from weight_sync.reload.api import begin_update
from weight_sync.testing import hf_config, make_checkpoint, random_weights
from weight_sync.transport.routes import plan_routes
from weight_sync.transport.routes_layouts import fsdp_holdings, needs_from_model
from weight_sync.transport.routes_reference import reference_checkpoint_metas
from weight_sync.transport.sharded_sink import RegionSink


def _graph_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _write_sharded(model: torch.nn.Module, begin, weights: dict[str, torch.Tensor], rank: int, version: int) -> int:
    """One update of ``model`` as engine rank ``rank`` receives it from 2 FSDP ranks: the second sender's
    regions first (out of block order across senders), each written where the reload plan says."""
    metas = [m for m in reference_checkpoint_metas(model.config) if m.name in weights]
    session = begin(Manifest(tuple(metas), version=version))
    needs = needs_from_model(model, metas, rank)
    plan = plan_routes(fsdp_holdings(metas, 2), needs)
    sink = RegionSink(session, needs, rank)
    routes = sorted(plan.routes(dst_rank=rank), key=lambda r: -r.src_rank)
    for r in routes:
        src = weights[r.name][tuple(slice(a, b) for a, b in r.src_box)]
        sink.write(r.name, r.param, r.dst_offset, r.dst_stride, r.src_box, src)
    assert sink.incomplete() == []
    session.finish()
    return sink.region_bytes


@pytest.mark.parametrize(("arch", "quantization"), [
    pytest.param("qwen3", None, id="qwen3-direct"),
    pytest.param("qwen3", "fp8", id="qwen3-fp8-processed"),
    # Layers a reload would quantize band by band (reload/bands.py) are staged for regions.
    pytest.param("qwen3", "fp8_per_channel", id="qwen3-fp8-channel-staged-not-banded"),
    pytest.param("qwen3_moe", "fp8", id="qwen3_moe-fp8-units"),
])
def test_regions_into_a_live_engine_equal_whole_tensor_loads(tmp_path: Path, arch: str, quantization) -> None:
    ckpt = make_checkpoint(tmp_path / "a", arch=arch, preset="tiny", seed=1, tokenizer=False)
    sharded = ReferenceEngine.from_checkpoint(ckpt, quantization=quantization, use_cuda_graph=False)
    whole = ReferenceEngine.from_checkpoint(ckpt, quantization=quantization, use_cuda_graph=False)
    before = {n: t.data_ptr() for n, t in _graph_tensors(sharded.model).items()}
    for version, seed in ((1, 2), (2, 3)):
        weights = dict(random_weights(hf_config(arch, "tiny"), seed=seed))
        _write_sharded(sharded.model, sharded.begin_update, weights, 0, version)
        with whole.begin_update(Manifest.from_named_tensors(weights.items(), version=version)) as s:
            s.load(list(weights.items()))
        got, want = _graph_tensors(sharded.model), _graph_tensors(whole.model)
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), (version, name)
    # Kernel tensors kept their storage: captured graphs stay valid.
    assert {n: t.data_ptr() for n, t in _graph_tensors(sharded.model).items()} == before


@pytest.mark.parametrize(("arch", "ep"), [pytest.param("qwen3", False, id="qwen3-tp2"),
                                          pytest.param("qwen3_moe", True, id="qwen3_moe-ep2")])
def test_each_tp_or_ep_rank_receives_only_its_shard_and_equals_a_fresh_load(arch: str, ep: bool) -> None:
    hf = hf_config(arch, "tiny")
    cfg = ModelConfig.from_hf_dict(hf)
    weights = dict(random_weights(hf, seed=4))
    model_bytes = sum(t.nbytes for t in weights.values())
    for rank in range(2):
        model = CausalLM(cfg, tp=FixedTP(fixed_size=2, fixed_rank=rank), expert_parallel=ep)
        moved = _write_sharded(model, lambda m, model=model: begin_update(model, m), weights, rank, 1)
        fresh = CausalLM(cfg, tp=FixedTP(fixed_size=2, fixed_rank=rank), expert_parallel=ep)
        fresh.load_weights(weights.items())
        got = dict(model.named_parameters())
        for name, t in fresh.named_parameters():
            assert torch.equal(got[name], t), (rank, name)
        assert moved < 0.6 * model_bytes  # its shard (and the small tensors every rank keeps whole)


def test_a_region_the_rank_does_not_need_or_too_many_elements_are_refused_by_name(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "a", preset="tiny", tokenizer=False)
    engine = ReferenceEngine.from_checkpoint(ckpt, use_cuda_graph=False)
    metas = reference_checkpoint_metas(engine.config)
    session = engine.begin_update(Manifest(tuple(metas), version=1))
    needs = needs_from_model(engine.model, metas, 0)
    sink = RegionSink(session, needs, 0)
    norm = next(n for n in needs if n.name.endswith("input_layernorm.weight"))
    box = norm.pieces[0].box
    with pytest.raises(LayoutMismatchError, match="a key this rank does not need"):
        sink.write("model.layers.0.nonexistent.weight", norm.param, 0, (1,), box, torch.zeros(4))
    too_many = torch.zeros(norm.shape[0] + 1, dtype=norm.dtype)
    with pytest.raises(LayoutMismatchError, match=f"{norm.name}: {norm.shape[0] + 1} more elements"):
        sink.write(norm.name, norm.param, 0, (1,), ((0, norm.shape[0] + 1),), too_many)
    session.abort("test")
    with pytest.raises(UpdateStateError, match="writes into an UpdateSession"):
        RegionSink(object(), needs, 0)
