"""RolloutWorker answers vLLM's method names directly and through collective_rpc."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainers import RolloutWorker
from trainers.rollout import RPC_METHODS
from weight_sync.engine import ReferenceEngine
from weight_sync.errors import UpdateStateError


def test_collective_rpc_reload_weights_from_a_path_matches_a_fresh_load(qwen3_a: Path, qwen3_b: Path) -> None:
    worker = RolloutWorker(str(qwen3_a))
    report = worker.collective_rpc("reload_weights", kwargs={"weights_path": str(qwen3_b), "version": 5})
    assert report["version"] == 5 == worker.collective_rpc("get_weight_version")
    assert worker.collective_rpc("fingerprint") == ReferenceEngine.from_checkpoint(qwen3_b).fingerprint()
    out = worker.collective_rpc("generate", args=([[5, 6, 7]], 3))
    assert len(out[0]) == 3


def test_collective_rpc_reload_weights_from_an_iterator(qwen3_a: Path, qwen3_b: Path) -> None:
    from weight_sync.safetensors_io import iter_checkpoint

    worker = RolloutWorker(str(qwen3_a))
    worker.collective_rpc("reload_weights", kwargs={"weights_iterator": iter_checkpoint(qwen3_b)})
    assert worker.fingerprint() == ReferenceEngine.from_checkpoint(qwen3_b).fingerprint()


def test_collective_rpc_rejects_unknown_methods_and_accepts_callables(qwen3_a: Path) -> None:
    worker = RolloutWorker(str(qwen3_a))
    with pytest.raises(ValueError, match="unknown method 'load_model'"):
        worker.collective_rpc("load_model")
    assert worker.collective_rpc(lambda w, x: (w.tp_size, x), args=(3,)) == (1, 3)
    assert {"init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update",
            "get_weight_version", "reload_weights"} <= set(RPC_METHODS)


def test_an_update_before_init_weight_transfer_engine_names_the_missing_step(qwen3_a: Path) -> None:
    worker = RolloutWorker(str(qwen3_a))
    with pytest.raises(UpdateStateError, match="init_weight_transfer_engine"):
        worker.start_weight_update()
