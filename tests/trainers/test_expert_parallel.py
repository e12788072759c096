"""An expert-parallel trainer (EP=2, spawned ranks, gloo) updates an engine with each rank's own experts."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from tests.trainers.ep_ranks import (
    BAD_EXPERT,
    NUM_EXPERTS,
    module_model,
    send_own_part,
    stacked_model,
)
from trainers.expert_parallel import ExpertParallelSource, expert_id
from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ConfigError, ManifestError
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.testing import make_checkpoint
from weight_sync.transport import WeightReceiver
from weight_sync.transport.joined import JoinedUpdate, receive_joined

EP = 2


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep_moe")
    return {k: make_checkpoint(root / k, arch="qwen3_moe", seed=s) for k, s in (("a", 0), ("b", 1))}


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in iter_checkpoint(path)}


def _run_ep_update(engine: ReferenceEngine, ckpt: Path, layout: str, bad: bool = False):
    """EP ranks send their parts of ``ckpt`` into ``engine``: (engine report or error, what each rank sent)."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(EP):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=send_own_part, args=(child, rank, EP, str(ckpt), layout, bad))
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        joined = JoinedUpdate(engine, EP)
        receivers = []
        for rank, conn in enumerate(pipes):
            assert conn.poll(120), f"EP rank {rank} did not start its sender within 120 s"
            r = WeightReceiver(joined.part(rank), conn.recv())
            r.connect()
            receivers.append(r)
        try:
            report = receive_joined(receivers)
        except Exception as e:
            report = e
        sent = []
        for rank, conn in enumerate(pipes):
            assert conn.poll(120), f"EP rank {rank} did not report within 120 s"
            sent.append(conn.recv())
        for r in receivers:
            r.close()
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * EP
    return report, sent


@pytest.mark.parametrize(("layout", "quantization"), [("stacked", None), ("modules", None), ("modules", "fp8")])
def test_an_ep2_trainer_update_equals_a_fresh_load_and_no_rank_sends_another_ranks_experts(
    layout, quantization, moe
) -> None:
    engine = ReferenceEngine.from_checkpoint(moe["a"], quantization=quantization, use_cuda_graph=False)
    report, sent = _run_ep_update(engine, moe["b"], layout)
    fresh = ReferenceEngine.from_checkpoint(moe["b"], quantization=quantization, use_cuda_graph=False)
    assert report.version == "b" and not report.partial
    assert engine.fingerprint() == fresh.fingerprint()
    for (name, t), (fname, ft) in zip(engine.model.state_dict().items(), fresh.model.state_dict().items(), strict=True):
        assert name == fname and torch.equal(t, ft), name
    experts = {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    if quantization == "fp8":  # per-tensor scales per expert: each expert's bands quantized together
        assert experts <= set(report.layers_banded) and report.units_processed == 0
    elif quantization is not None:  # every expert completed and was quantized on its own
        assert report.units_processed == 2 * NUM_EXPERTS

    b = _checkpoint(moe["b"])
    per_rank = NUM_EXPERTS // EP
    for rank, part in enumerate(sent):
        ids = {expert_id(n) for n in part["names"]} - {None}
        assert ids == set(range(rank * per_rank, (rank + 1) * per_rank))
        replicated = [n for n in part["names"] if expert_id(n) is None]
        assert bool(replicated) == (rank == 0)  # rank 0 alone sends the replicated tensors
        own_bytes = sum(b[n].numel() * b[n].element_size() for n in part["names"])
        assert part["num_bytes"] == part["source_bytes"] == own_bytes
    names = [n for part in sent for n in part["names"]]
    assert sorted(names) == sorted(b)  # every tensor sent once, by exactly one rank
    assert sum(part["num_bytes"] for part in sent) == sum(t.numel() * t.element_size() for t in b.values())


def test_a_part_with_a_wrong_expert_shape_is_refused_to_every_rank_before_any_write(moe) -> None:
    engine = ReferenceEngine.from_checkpoint(moe["a"], quantization="fp8", use_cuda_graph=False)
    before = engine.fingerprint()
    error, sent = _run_ep_update(engine, moe["b"], "modules", bad=True)
    assert isinstance(error, Exception) and BAD_EXPERT in str(error) and "(64, 128)" in str(error)
    assert BAD_EXPERT in sent[1]["error"]  # refused at its start, naming the tensor
    assert "before all 2 parts started" in sent[0]["error"]  # rank 0's data is refused, not half-applied
    assert engine.fingerprint() == before
    assert engine.generate([[1, 2, 3]], max_new_tokens=2)  # serving A, not torn


def test_a_stacked_trainer_model_splits_into_per_expert_hf_names_as_views(moe) -> None:
    model = stacked_model(str(moe["b"]), rank=1, ep_size=EP)
    source = ExpertParallelSource(model, ep_rank=1, ep_size=EP, num_experts=NUM_EXPERTS)
    names = source.manifest().names
    layer0 = [n for n in names if n.startswith("model.layers.0.mlp.experts.")]
    assert layer0[:3] == [f"model.layers.0.mlp.experts.4.{p}_proj.weight" for p in ("gate", "up", "down")]
    b = _checkpoint(moe["b"])
    stacked = model.model.layers[0].mlp.experts.gate_up_proj
    for name, t in source:
        assert torch.equal(t, b[name]), name
        if name == "model.layers.0.mlp.experts.5.up_proj.weight":
            assert t.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()  # no copy


def test_an_expert_outside_the_ranks_range_or_a_missing_projection_is_refused_naming_it(moe) -> None:
    model = module_model(str(moe["b"]), rank=0, ep_size=EP)
    # Rank 0's experts (local ids 0..3) announced as rank 1's with global ids: 0..3 are not rank 1's.
    with pytest.raises(ConfigError, match=r"experts\.0\.\w+_proj\.weight .*EP rank 1 of 2 holds experts 4\.\.7, got expert 0"):
        ExpertParallelSource(model, ep_rank=1, ep_size=EP, num_experts=NUM_EXPERTS, local_ids=False)
    del model.get_submodule("model.layers.1.mlp.experts.2.down_proj")._parameters["weight"]
    with pytest.raises(ConfigError, match=r"model\.layers\.1\.mlp\.experts\.2\.down_proj\.weight: EP rank 0 must send"):
        ExpertParallelSource(model, ep_rank=0, ep_size=EP, num_experts=NUM_EXPERTS)


def test_a_joined_update_refuses_a_tensor_announced_by_two_parts_before_any_write(moe) -> None:
    engine = ReferenceEngine.from_checkpoint(moe["a"], use_cuda_graph=False)
    before = engine.fingerprint()
    b = _checkpoint(moe["b"])
    metas = [TensorMeta.of(n, t) for n, t in b.items()]
    joined = JoinedUpdate(engine, 2)
    joined.part(0).begin_update(Manifest(tuple(m for m in metas if expert_id(m.name) in (None, 0, 1, 2, 3))))
    with pytest.raises(ManifestError, match=r"part 1 announces 'model\.layers\.0\.mlp\.experts\.3\.\w+_proj\.weight', which part 0 "
                                           r"announces too \(6 name\(s\) in both\)"):
        joined.part(1).begin_update(Manifest(tuple(m for m in metas if expert_id(m.name) in (3, 4, 5, 6, 7))))
    assert engine.fingerprint() == before
    assert engine.generate([[1, 2, 3]], max_new_tokens=2)  # serving, not torn


def test_a_module_source_sends_a_transformers_moe_model_per_expert_and_reloads_an_engine_bitwise(moe) -> None:
    from trainers import ModuleSource
    from weight_sync import begin_update

    model = stacked_model(str(moe["b"]), rank=0, ep_size=1)  # the whole model, as transformers holds it
    source = ModuleSource(model)
    b = _checkpoint(moe["b"])
    assert sorted(source.manifest().names) == sorted(b)
    engine = ReferenceEngine.from_checkpoint(moe["a"], quantization="fp8", use_cuda_graph=False)
    with begin_update(engine.model, source.manifest()) as session:
        session.load(source)
    # Each expert's keys adjacent: its gate half waits (copied) only until its up half arrives.
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(session.report.layers_banded)
    assert session.report.peak_buffered_bytes < NUM_EXPERTS * 3 * 64 * 128 * 2  # never a whole layer
    fresh = ReferenceEngine.from_checkpoint(moe["b"], quantization="fp8", use_cuda_graph=False)
    assert engine.fingerprint() == fresh.fingerprint()
