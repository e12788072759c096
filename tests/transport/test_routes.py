"""Route plans: FSDP-style trainer holdings x reference-engine TP/EP needs, applied with plain copies."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transport import _routes_ranks
from tests.transport._routes_ranks import FixedTP
from weight_sync.engine.config import ModelConfig
from weight_sync.engine.model import CausalLM
from weight_sync.errors import ManifestError
from weight_sync.manifest import TensorMeta
from weight_sync.testing import hf_config, make_checkpoint, random_weights, run_distributed
from weight_sync.transport.routes import (
    Holding,
    Need,
    NeedPiece,
    Piece,
    RoutePlanCache,
    copy_routes,
    layout_digest,
    plan_routes,
)
from weight_sync.transport.routes_layouts import (
    fsdp_holdings,
    holdings_from_placements,
    merge_needs,
    needs_from_model,
    whole_holdings,
)
from weight_sync.transport.routes_reference import (
    reference_checkpoint_metas,
    reference_engine_needs,
)

# (arch, expert_parallel, config overrides): dense TP, KV heads replicated + padded vocab, MoE EP and TP,
# a tied head (the engine ignores lm_head).
LAYOUTS = [
    pytest.param("qwen3", False, {}, id="qwen3-tp2"),
    pytest.param("qwen3", False, {"vocab_size": 1000, "num_key_value_heads": 1}, id="qwen3-tp2-kv1-pad"),
    pytest.param("qwen3_moe", True, {}, id="qwen3_moe-ep2"),
    pytest.param("qwen3_moe", False, {}, id="qwen3_moe-tp2"),
    pytest.param("llama", False, {"tie_word_embeddings": True}, id="llama-tied-tp2"),
]


def _engine_rank(cfg: ModelConfig, rank: int, ep: bool) -> CausalLM:
    return CausalLM(cfg, tp=FixedTP(fixed_size=2, fixed_rank=rank), expert_parallel=ep)


def _slices(box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


@pytest.mark.parametrize(("arch", "ep", "overrides"), LAYOUTS)
def test_applying_the_plan_reproduces_each_engine_ranks_shard_bitwise(arch, ep, overrides) -> None:
    hf = hf_config(arch, "tiny", **overrides)
    cfg = ModelConfig.from_hf_dict(hf)
    full = dict(random_weights(hf, seed=3))
    metas = reference_checkpoint_metas(cfg)
    holdings = fsdp_holdings(metas, 2)
    pieces = {(h.name, p.rank): p.box for h in holdings for p in h.pieces}
    plan = plan_routes(holdings, reference_engine_needs(cfg, tp_size=2, expert_parallel=ep))
    for rank in range(2):
        loaded = _engine_rank(cfg, rank, ep)
        loaded.load_weights(full.items())  # the engine's own loaders: the shard to reproduce
        fresh = _engine_rank(cfg, rank, ep)  # zero-filled: an element no route writes stays 0
        params = dict(fresh.named_parameters())
        moved = copy_routes(
            plan.routes(dst_rank=rank), lambda n, s: full[n][_slices(pieces[(n, s)])], params
        )
        for name, want in loaded.named_parameters():
            assert torch.equal(params[name], want), name
        assert moved == plan.bytes_received()[rank] == plan.needed_bytes()[rank]


@pytest.mark.parametrize(("arch", "ep", "overrides"), LAYOUTS)
def test_needs_computed_from_the_config_equal_the_needs_recorded_from_the_engines_reload_plan(
    arch, ep, overrides
) -> None:
    cfg = ModelConfig.from_hf_dict(hf_config(arch, "tiny", **overrides))
    metas = reference_checkpoint_metas(cfg)
    recorded = merge_needs(
        (needs_from_model(_engine_rank(cfg, r, ep), metas, r) for r in range(2)),
        order=[m.name for m in metas],
    )
    computed = reference_engine_needs(cfg, tp_size=2, expert_parallel=ep)
    assert computed == recorded


def test_real_tp2_engines_on_gloo_receive_exactly_their_shards_dense_and_moe_ep2(tmp_path: Path) -> None:
    dense = make_checkpoint(tmp_path / "dense", arch="qwen3", seed=4, tokenizer=False)
    moe = make_checkpoint(tmp_path / "moe", arch="qwen3_moe", seed=5, tokenizer=False)
    for ckpt, ep, arch in ((dense, False, "qwen3"), (moe, True, "qwen3_moe")):
        results = run_distributed(_routes_ranks.engine_rank_applies_its_routes, 2, str(ckpt), ep)
        assert [r["wrong"] for r in results] == [[], []]
        assert [r["moved"] for r in results] == [r["needed"] for r in results]
        cfg = ModelConfig.from_pretrained(ckpt)
        order = [m.name for m in reference_checkpoint_metas(cfg)]
        assert merge_needs((r["needs"] for r in results), order=order) == reference_engine_needs(
            cfg, tp_size=2, expert_parallel=ep
        ), arch


def test_holdings_read_off_fsdp2_dtensors_match_every_ranks_local_shard(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "hf", arch="qwen3", seed=6, tokenizer=False)
    results = run_distributed(_routes_ranks.fsdp_rank_announces_its_shards, 2, str(ckpt))
    assert [r["mismatched"] for r in results] == [[], []]
    assert results[0]["holdings"] == results[1]["holdings"]  # every rank announces the same layout
    embed = next(h for h in results[0]["holdings"] if h.name == "model.embed_tokens.weight")
    assert embed.pieces == (Piece(0, ((0, 512), (0, 128))), Piece(1, ((512, 1024), (0, 128))))


def test_shard_placements_follow_torch_chunking_with_a_short_and_an_empty_tail() -> None:
    from torch.distributed.tensor import Replicate, Shard

    h = holdings_from_placements("w", (10, 4), torch.float32, [0, 1, 2, 3], [Shard(0)])
    assert [p.box[0] for p in h.pieces] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    h = holdings_from_placements("w", (5, 4), torch.float32, [0, 1, 2, 3], [Shard(0)])
    assert [p.box[0] for p in h.pieces] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    # HSDP: replicated over the outer mesh dimension, sharded over the inner one.
    h = holdings_from_placements("w", (8, 4), torch.float32, [[0, 1], [2, 3]], [Replicate(), Shard(0)])
    assert [(p.rank, p.box[0]) for p in h.pieces] == [(0, (0, 4)), (1, (4, 8)), (2, (0, 4)), (3, (4, 8))]
    # Two mesh dimensions sharding one tensor dimension split it in mesh order.
    h = holdings_from_placements("w", (8, 4), torch.float32, [[0, 1], [2, 3]], [Shard(0), Shard(0)])
    assert [p.box[0] for p in h.pieces] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_replicated_holdings_spread_engine_ranks_over_the_replicas() -> None:
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3", "tiny"))
    metas = reference_checkpoint_metas(cfg)
    plan = plan_routes(whole_holdings(metas, [0, 1]), reference_engine_needs(cfg, tp_size=2))
    assert {(s, d) for s, d in plan.bytes_per_link()} == {(0, 0), (1, 1)}
    assert plan.bytes_received() == plan.needed_bytes()


def test_sharded_plan_moves_each_engine_rank_its_shard_where_broadcast_moves_the_whole_model() -> None:
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3", "tiny"))
    metas = reference_checkpoint_metas(cfg)
    plan = plan_routes(fsdp_holdings(metas, 2), reference_engine_needs(cfg, tp_size=2, num_engines=2))
    model = sum(m.numel * m.dtype.itemsize for m in metas)
    assert plan.model_bytes == model
    assert plan.broadcast_bytes_per_link(root=0) == {(0, d): model for d in range(4)}
    received = plan.bytes_received()
    assert sorted(received) == [0, 1, 2, 3]
    # Only norms are replicated across TP ranks: each rank gets half of the rest.
    norms = sum(m.numel * m.dtype.itemsize for m in metas if m.name.endswith("norm.weight"))
    assert all(n == (model - norms) // 2 + norms for n in received.values())
    assert max(plan.bytes_per_link().values()) < model


def test_a_plan_is_reused_while_the_layouts_are_unchanged() -> None:
    cfg = ModelConfig.from_hf_dict(hf_config("qwen3", "tiny"))
    metas = reference_checkpoint_metas(cfg)
    holdings, needs = fsdp_holdings(metas, 2), reference_engine_needs(cfg, tp_size=2)
    cache = RoutePlanCache()
    first = cache.get(holdings, needs)
    assert cache.get(fsdp_holdings(metas, 2), reference_engine_needs(cfg, tp_size=2)) is first
    assert cache.num_planned == 1
    other = cache.get(fsdp_holdings(metas, [0, 1, 2]), needs)
    assert other is not first and other.digest != first.digest and cache.num_planned == 2
    assert layout_digest(holdings, needs) == first.digest


def _w(name: str = "w", shape: tuple[int, ...] = (8, 4)) -> TensorMeta:
    return TensorMeta(name, torch.float32, shape)


def _whole_need(name: str = "w", shape: tuple[int, ...] = (8, 4), rank: int = 0) -> Need:
    return Need(name=name, shape=shape, dtype=torch.float32, param=name,
                pieces=(NeedPiece(rank, tuple((0, n) for n in shape), 0, (shape[1], 1)),))


def test_a_needed_tensor_nobody_holds_is_a_manifest_error_naming_it() -> None:
    with pytest.raises(ManifestError, match=r"lm_head.weight: needed by engine ranks \[0\], held by no"):
        plan_routes(fsdp_holdings([_w()], 2), [_whole_need(), _whole_need("lm_head.weight")])


def test_two_ranks_claiming_overlapping_different_regions_is_a_manifest_error_naming_them() -> None:
    bad = Holding(name="w", shape=(8, 4), dtype=torch.float32,
                  pieces=(Piece(0, ((0, 5), (0, 4))), Piece(1, ((4, 8), (0, 4)))))
    with pytest.raises(ManifestError, match=r"w: trainer ranks 0 and 1 claim overlapping regions "
                                            r"\[0:5, 0:4\] and \[4:8, 0:4\]"):
        plan_routes([bad], [_whole_need()])


def test_a_region_no_rank_holds_is_a_manifest_error_naming_the_engine_rank() -> None:
    gap = Holding(name="w", shape=(8, 4), dtype=torch.float32, pieces=(Piece(0, ((0, 4), (0, 4))),))
    with pytest.raises(ManifestError, match=r"w: engine rank 0 needs \[0:8, 0:4\] \(32 elements\), "
                                            r"the trainer ranks hold 16"):
        plan_routes([gap], [_whole_need()])


def test_layouts_that_disagree_on_shape_or_dtype_are_a_manifest_error() -> None:
    with pytest.raises(ManifestError, match=r"w: engine ranks expect \(8, 4\) float32, trainer ranks hold "
                                            r"\(8, 5\) float32"):
        plan_routes(fsdp_holdings([_w(shape=(8, 5))], 2), [_whole_need()])


def test_a_claim_outside_the_tensor_and_duplicate_announcements_are_manifest_errors() -> None:
    out = Holding(name="w", shape=(8, 4), dtype=torch.float32, pieces=(Piece(3, ((0, 9), (0, 4))),))
    with pytest.raises(ManifestError, match=r"w: trainer rank 3 claims \[0:9, 0:4\], outside"):
        plan_routes([out], [_whole_need()])
    with pytest.raises(ManifestError, match=r"w: announced twice by the engine side"):
        plan_routes(fsdp_holdings([_w()], 2), [_whole_need(), _whole_need(rank=1)])


def test_a_partial_placement_is_refused_by_name() -> None:
    from torch.distributed.tensor import Partial

    with pytest.raises(ManifestError, match=r"w: placement Partial"):
        holdings_from_placements("w", (8, 4), torch.float32, [0, 1], [Partial()])
