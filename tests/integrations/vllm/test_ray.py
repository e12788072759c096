"""A vLLM engine inside a Ray actor, driven by the trainer package's RayRolloutClient over gloo."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import ENGINE_ARGS, MAX_TOKENS, PROMPTS
from trainers import CheckpointSource

pytest.importorskip("vllm")
ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.vllm, pytest.mark.ray, pytest.mark.slow]


# An in-process engine keeps each actor to one process on this 2-core machine.
IN_PROCESS = {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}}


@pytest.fixture(scope="module")
def ray_session():
    import os

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def rollout_client(ray_session, vllm_ckpts: dict[str, Path], fresh_tokens):
    from trainers.ray_client import RayRolloutClient
    from weight_sync.integrations.vllm import VLLMRolloutWorker
    from weight_sync.transport import TransportConfig

    actor_cls = ray.remote(VLLMRolloutWorker)
    worker = actor_cls.options(num_cpus=1, runtime_env=IN_PROCESS).remote(
        str(vllm_ckpts["a"]), llm_kwargs=ENGINE_ARGS
    )
    client = RayRolloutClient([worker], TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=60))
    try:
        yield client
    finally:
        client.collective_rpc("shutdown")
        client.shutdown()


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



def test_vllms_trainer_api_with_its_ray_client_drives_weight_syncs_sender_into_an_llm_actor(
    ray_session, vllm_ckpts, fresh_tokens
) -> None:
    # Upstream's Ray flow unchanged but for the init info: an `LLM` actor with weight_sync's engine
    # kwargs, vLLM's RayVLLMWeightSyncClient as the control plane, a transformers model as the source.
    # (No weight_version: that client sets it through `update_weight_version`, which only AsyncLLM has.)
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer import (
        ModuleSource,
        RayVLLMWeightSyncClient,
        WeightTransferTrainerFactory,
    )

    from tests.integrations.vllm.test_transfer import hf_trainer_model, load_trainer_weights
    from weight_sync.integrations.vllm import engine_kwargs
    from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo

    llm = ray.remote(LLM).options(num_cpus=1, runtime_env=IN_PROCESS).remote(
        model=str(vllm_ckpts["a"]), **ENGINE_ARGS, **engine_kwargs())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def tokens() -> list[list[int]]:
        outputs = ray.get(llm.generate.remote(PROMPTS, params, use_tqdm=False))
        return [list(o.outputs[0].token_ids) for o in outputs]

    model = hf_trainer_model(vllm_ckpts["b"])
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightSyncTrainerInitInfo(world_size=2, rank=0, transport="gloo", timeout_s=60.0),
        client=RayVLLMWeightSyncClient(llm), source=ModuleSource(model))
    try:
        assert tokens() == fresh_tokens["a"]
        engine.send_weights()
        assert tokens() == fresh_tokens["b"]
        load_trainer_weights(model, vllm_ckpts["a"])
        engine.send_weights()
        assert tokens() == fresh_tokens["a"]
    finally:
        engine.shutdown()
        ray.kill(llm)
