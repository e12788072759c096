"""Scale-out on a local Ray cluster: FSDP2 trainer actors -> TP engine actors through placement groups,
each engine rank receiving only its shard over the sharded data plane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from weight_sync.engine.config import ModelConfig
from weight_sync.testing import make_checkpoint
from weight_sync.transport.routes import plan_routes
from weight_sync.transport.routes_layouts import fsdp_holdings
from weight_sync.transport.routes_reference import (
    reference_checkpoint_metas,
    reference_engine_needs,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield
        ray.shutdown()


def _stepped(ckpt: Path, out: Path, scales: list[float]) -> str:
    """The checkpoint after the trainers' steps, whole (what a fresh engine should equal)."""
    full = load_file(str(ckpt / "model.safetensors"))
    for s in scales:
        for t in full.values():
            t.add_(s)
    out.mkdir()
    save_file(full, str(out / "model.safetensors"))
    return str(out)


def test_trainer_and_engine_actor_groups_sync_bitwise_with_each_rank_receiving_its_shard(
    ray_cluster, tmp_path: Path
) -> None:
    from trainers.ray_scale import RayScaleOut

    ckpt = make_checkpoint(tmp_path / "m", arch="qwen3", preset="tiny", tokenizer=False)
    cfg = ModelConfig.from_hf_dict(json.loads((ckpt / "config.json").read_text()))
    metas = reference_checkpoint_metas(cfg)
    plan = plan_routes(fsdp_holdings(metas, 2), reference_engine_needs(cfg, tp_size=2))
    job = RayScaleOut.launch(str(ckpt), num_trainers=2, num_engines=1, tp_size=2, num_cpus=0.5,
                             config={"bucket_bytes": 64 << 10, "timeout_s": 60.0, "mode": "sharded"})
    try:
        assert [c["engine_rank"] for c in job.connect()] == [0, 1]
        scales = []
        for version in (1, 2):
            scales.append(0.01 * version)
            job.train_step(scales[-1])
            out = job.sync(version)
            expected = _stepped(ckpt, tmp_path / f"v{version}", scales)
            assert job.engine_rpc("differs_from", expected) == [[], []]
            for e in out["engines"]:
                assert e["version"] == version and e["mode"] == "sharded"
                assert sum(e["region_bytes"].values()) == plan.needed_bytes()[e["engine_rank"]]
            sent = {(t["rank"], int(d)): n for t in out["trainers"] for d, n in t["region_bytes"].items()}
            assert sent == plan.bytes_per_link()
    finally:
        job.shutdown()
