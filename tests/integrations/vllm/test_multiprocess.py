"""A multiprocess vLLM engine (workers in their own processes): reloads and pushes cross processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import checkpoint_items, greedy, start_llm, stop_llm

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def llm(vllm_ckpts: dict[str, Path], fresh_tokens):
    engine = start_llm(vllm_ckpts["a"], multiprocess=True)
    yield engine
    stop_llm(engine)


def test_reload_from_a_path_and_from_iterators_reaches_worker_processes(llm, vllm_ckpts, fresh_tokens) -> None:
    [report] = llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
    assert report["num_tensors"] == 25
    assert greedy(llm) == fresh_tokens["b"]
    items = checkpoint_items(vllm_ckpts["a"])
    # Tensors cannot cross vLLM's RPC (pickle fails on them); weight_sync spools them through /dev/shm.
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items[::-1]})
    assert greedy(llm) == fresh_tokens["a"]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(checkpoint_items(vllm_ckpts["b"]))})
    assert greedy(llm) == fresh_tokens["b"]


def test_a_lazy_iterator_with_a_wrong_shape_is_refused_before_any_write(llm, vllm_ckpts, fresh_tokens) -> None:
    import torch

    name = "model.layers.0.mlp.down_proj.weight"
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    stream = ((n, torch.zeros(128, 7, dtype=torch.bfloat16) if n == name else t)
              for n, t in checkpoint_items(vllm_ckpts["b"]))
    with pytest.raises(Exception, match=rf"{name}.*\(128, 256\).*\(128, 7\)"):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
    assert llm.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(llm) == fresh_tokens["a"]


def test_pushes_over_gloo_from_this_trainer_process_reach_the_worker_process(llm, vllm_ckpts, fresh_tokens) -> None:
    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient

    with WeightSyncClient(LLMControl(llm)) as client:
        client.connect()
        report = client.push(dict(checkpoint_items(vllm_ckpts["b"])), version=11)
        assert [r["version"] for r in report.receivers] == [11]
        assert greedy(llm) == fresh_tokens["b"]
        client.push(dict(checkpoint_items(vllm_ckpts["a"])), version=12)
        assert greedy(llm) == fresh_tokens["a"]
        assert client.weight_version() == "12"
        assert client.last_report()[0]["version"] == 12
        assert client.status() == [{"torn": None, "version": 12, "updating": False}]


def test_a_killed_trainer_makes_every_request_finish_with_an_error_until_a_good_push(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    from vllm import SamplingParams

    from tests.integrations.vllm.test_transfer import Trainer
    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient

    dying = Trainer([("die", vllm_ckpts["b"])])
    llm.init_weight_transfer_engine({"init_info": {"address": dying.address}})
    llm.start_weight_update()
    with pytest.raises(Exception, match=r"update_weights: receive of bucket"):
        llm.update_weights({"update_info": {}})
    assert dying.join() == -9
    assert "update 1 failed: TransportError" in llm.collective_rpc("ws_status")[0]["torn"]
    [out] = llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and list(out.outputs[0].token_ids) == []
    with WeightSyncClient(LLMControl(llm)) as client:
        client.connect()
        client.push(dict(checkpoint_items(vllm_ckpts["b"])), version=21)
    assert llm.collective_rpc("ws_status")[0]["torn"] is None
    assert greedy(llm) == fresh_tokens["b"]
