"""The sharded data plane: FSDP2 trainer ranks -> TP engine ranks, each engine rank receiving only its shard."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tests.transport import _sharded_ranks
from weight_sync.engine.config import ModelConfig
from weight_sync.errors import ConfigError, ManifestError
from weight_sync.testing import hf_config, make_checkpoint, run_distributed
from weight_sync.transport.routes import plan_routes
from weight_sync.transport.routes_layouts import fsdp_holdings, whole_holdings
from weight_sync.transport.routes_reference import (
    reference_checkpoint_metas,
    reference_engine_needs,
)
from weight_sync.transport.sharded import ShardedConfig
from weight_sync.transport.sharded_plan import (
    Item,
    broadcast_items,
    choose_mode,
    cut_buckets,
    cut_digest,
    holdings_from_json,
    holdings_to_json,
    needs_from_json,
    needs_to_json,
    sharded_items,
)


def _tiny_plan(num_trainers: int = 2, tp: int = 2, num_engines: int = 2):
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3", "tiny"))
    metas = reference_checkpoint_metas(cfg)
    holdings = fsdp_holdings(metas, num_trainers)
    needs = reference_engine_needs(cfg, tp_size=tp, num_engines=num_engines)
    return metas, holdings, needs, plan_routes(holdings, needs)


def test_layouts_survive_json_with_shared_patterns_kept_shared() -> None:
    _, holdings, needs, plan = _tiny_plan()
    h2 = holdings_from_json(holdings_to_json(holdings))
    n2 = needs_from_json(needs_to_json(needs))
    assert h2 == holdings and n2 == needs
    q = [h.pieces for h in h2 if h.name.endswith("q_proj.weight")]
    assert len(q) == 2 and q[0] is q[1]  # one tuple per pattern: the planner intersects it once
    assert plan_routes(h2, n2).digest == plan.digest


def test_malformed_layout_json_is_a_manifest_error_naming_it() -> None:
    with pytest.raises(ManifestError, match="holdings JSON"):
        holdings_from_json('{"patterns": [[[0, [[0, "x"]]]]], "tensors": [["w", [4], "bfloat16", 0]]}')
    with pytest.raises(ManifestError, match="needs JSON: not JSON"):
        needs_from_json("{")


def test_buckets_hold_every_byte_of_every_item_once_within_the_size() -> None:
    items = [Item("a", torch.bfloat16, ((0, 100), (0, 64))), Item("b", torch.float32, ((0, 3),)),
             Item("c", torch.bfloat16, ((5, 6), (0, 3000)))]  # one row larger than a bucket
    buckets = cut_buckets(items, 4096)
    for b in buckets:
        assert b.nbytes <= 4096 and b.nbytes % 4 == 0
        ends = [(s.offset, s.offset + s.nbytes) for s in b.slots]
        assert all(e0 <= s1 for (_, e0), (s1, _) in itertools.pairwise(ends))  # in order, never overlapping
        assert all(s.offset % 16 == 0 for s in b.slots)
    for i, it in enumerate(items):
        covered = torch.zeros([b - a for a, b in it.box], dtype=torch.int32)
        origin = [a for a, _ in it.box]
        for b in buckets:
            for s in b.slots:
                if s.item == i:
                    covered[tuple(slice(a - o, b_ - o) for (a, b_), o in zip(s.box, origin))] += 1
        assert torch.equal(covered, torch.ones_like(covered)), it.name
    assert cut_digest(items, buckets) == cut_digest(list(items), cut_buckets(items, 4096))
    assert cut_digest(items, buckets) != cut_digest(items, cut_buckets(items, 8192))


def test_sharded_links_carry_exactly_each_engine_ranks_needed_bytes() -> None:
    _, _, _, plan = _tiny_plan()
    needed = plan.needed_bytes()
    for d in plan.dst_ranks:
        got = sum(it.nbytes for s in plan.src_ranks for it in sharded_items(plan, s, d))
        assert got == needed[d] < plan.model_bytes


def test_broadcast_items_send_each_distinct_piece_once_from_its_first_holder() -> None:
    metas, holdings, _, _ = _tiny_plan()
    total = sum(m.nbytes for m in metas)
    assert sum(it.nbytes for s in (0, 1) for it in broadcast_items(holdings, metas, s)) == total
    replicated = whole_holdings(metas, [0, 1])
    assert sum(it.nbytes for it in broadcast_items(replicated, metas, 0)) == total
    assert broadcast_items(replicated, metas, 1) == []


def test_auto_mode_broadcasts_only_where_it_loads_the_busiest_link_less() -> None:
    # 2 FSDP ranks -> 2 engines x TP2: each engine rank needs half the model; gloo's broadcast would
    # send each trainer's half to all four engine ranks.
    assert choose_mode(_tiny_plan()[3], "auto", "gloo") == "sharded"
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3", "tiny"))
    metas = reference_checkpoint_metas(cfg)
    # One holder, four TP=1 replicas: sharded sends the model four times from it; an NCCL ring carries
    # it once per link, gloo's root sends it four times (a tie: sharded stays).
    replicas = plan_routes(whole_holdings(metas, [0]), reference_engine_needs(cfg, tp_size=1, num_engines=4))
    assert choose_mode(replicas, "auto", "nccl") == "broadcast"
    assert choose_mode(replicas, "auto", "gloo") == "sharded"
    assert choose_mode(replicas, "sharded", "nccl") == "sharded"
    with pytest.raises(ConfigError, match="mode must be one of"):
        choose_mode(replicas, "fastest")


def test_config_refuses_values_it_cannot_run_naming_them() -> None:
    with pytest.raises(ConfigError, match="num_trainers and num_engine_ranks must be >= 1"):
        ShardedConfig(num_trainers=0, num_engine_ranks=2)
    with pytest.raises(ConfigError, match="bucket_bytes must be a multiple of 16"):
        ShardedConfig(num_trainers=1, num_engine_ranks=1, bucket_bytes=1000)
    cfg = ShardedConfig(num_trainers=2, num_engine_ranks=4, mode="sharded")
    assert ShardedConfig.from_json(cfg.to_json()) == cfg


def test_fsdp2_trainers_update_tp_engines_bitwise_sending_each_rank_only_its_shard(tmp_path: Path) -> None:
    ckpt = str(make_checkpoint(tmp_path / "m", arch="qwen3", preset="tiny", tokenizer=False))
    _, _, _, plan = _tiny_plan()
    num_updates = 3
    results = run_distributed(_sharded_ranks.fsdp_trainers_to_tp_engines, 6, ckpt, num_updates, timeout_s=300)
    trainers, engines = results[:2], results[2:]
    needed = plan.needed_bytes()
    for d, r in enumerate(engines):
        for u, up in enumerate(r["updates"]):
            assert up["version"] == u + 1
            assert up["wrong"] == [], (d, u)
        for up in r["updates"][:num_updates]:
            assert up["mode"] == "sharded"
            assert sum(up["region_bytes"].values()) == needed[d]
        assert sum(r["updates"][-1]["region_bytes"].values()) == plan.model_bytes  # broadcast: all of it
    assert needed[0] < plan.model_bytes // 2 + plan.model_bytes // 10  # half the model, plus the norms
    for s, r in enumerate(trainers):
        for up in r["updates"][:num_updates]:
            assert {int(d): n for d, n in up["region_bytes"].items()} == {
                d: n for (src, d), n in plan.bytes_per_link().items() if src == s
            }


def test_moe_trainers_update_expert_parallel_engine_ranks_with_only_their_experts(tmp_path: Path) -> None:
    ckpt = str(make_checkpoint(tmp_path / "moe", arch="qwen3_moe", preset="tiny", tokenizer=False))
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3_moe", "tiny"))
    metas = reference_checkpoint_metas(cfg)
    plan = plan_routes(fsdp_holdings(metas, 2), reference_engine_needs(cfg, tp_size=2, expert_parallel=True))
    results = run_distributed(_sharded_ranks.checkpoint_trainers_to_ep_engines, 4, ckpt, 2, timeout_s=300)
    for d, r in enumerate(results[2:]):
        for up in r["updates"]:
            assert up["wrong"] == [], d
            assert sum(up["region_bytes"].values()) == plan.needed_bytes()[d] < 0.6 * plan.model_bytes


@pytest.mark.multi_gpu
def test_nccl_point_to_point_updates_an_engine_on_another_gpu_bitwise(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ckpt = str(make_checkpoint(tmp_path / "m", arch="qwen3", preset="tiny", tokenizer=False))
    _, engine = run_distributed(_sharded_ranks.nccl_trainer_to_engine, 2, ckpt, timeout_s=300)
    assert engine == []
