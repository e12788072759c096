"""A vLLM engine inside a Ray actor, driven by the trainer package's RayRolloutClient over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import ENGINE_ARGS, MAX_TOKENS, PROMPTS
from trainers import CheckpointSource

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def rollout_client(vllm_ckpts: dict[str, Path], fresh_tokens):
    import os

    from trainers.ray_client import RayRolloutClient
    from weight_sync.integrations.vllm import VLLMRolloutWorker
    from weight_sync.transport import TransportConfig

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor_cls = ray.remote(VLLMRolloutWorker)
    # An in-process engine keeps the actor to one process on this 2-core machine.
    worker = actor_cls.options(num_cpus=1, runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}).remote(
        str(vllm_ckpts["a"]), llm_kwargs=ENGINE_ARGS
    )
    client = RayRolloutClient([worker], TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=60))
    try:
        yield client
    finally:
        client.collective_rpc("shutdown")
        client.shutdown()
        ray.shutdown()


def _prompt_ids(ckpt: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    return [tok(p).input_ids for p in PROMPTS]


def test_a_ray_rollout_client_pushes_into_a_vllm_actor_and_reads_it_back(rollout_client, vllm_ckpts, fresh_tokens) -> None:
    ids = _prompt_ids(vllm_ckpts["a"])
    assert rollout_client.collective_rpc("generate", args=(ids, MAX_TOKENS)) == [fresh_tokens["a"]]
    rollout_client.init_weight_transfer()
    report = rollout_client.sync(CheckpointSource(vllm_ckpts["b"]), version=1)
    assert [r["version"] for r in report.receivers] == [1]
    assert rollout_client.collective_rpc("generate", args=(ids, MAX_TOKENS)) == [fresh_tokens["b"]]
    rollout_client.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    assert rollout_client.collective_rpc("generate", args=(ids, MAX_TOKENS)) == [fresh_tokens["a"]]
    assert rollout_client.collective_rpc("status") == [{"torn": None, "version": None, "updating": False}]

