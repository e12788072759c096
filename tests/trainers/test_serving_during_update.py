"""An engine worker process refuses to generate while a weight update is open on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainers.remote import EngineProcesses, RemoteWorkerError
from weight_sync.engine import ReferenceEngine
from weight_sync.manifest import Manifest
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.transport import TransportConfig, WeightSender


def test_a_worker_process_refuses_to_generate_until_its_open_update_commits(qwen3_a: Path, qwen3_b: Path) -> None:
    items = list(iter_checkpoint(qwen3_b))
    with EngineProcesses(str(qwen3_a), 1, devices=["cpu"], dtype=None, timeout_s=120) as workers:
        sender = WeightSender(TransportConfig(backend="gloo", timeout_s=60), num_receivers=1)
        try:
            workers.submit_each("init_weight_transfer_engine", [({"address": sender.address, "rank": 1},)])
            sender.connect()
            workers.collect()
            workers.submit("start_weight_update")
            sender.start_weight_update(Manifest.from_named_tensors(items), version=9)
            workers.collect()
            with pytest.raises(RemoteWorkerError, match=r"generate failed: UpdateStateError: update 9 is open"):
                workers.call("generate", [[5, 6]], 3)
            workers.submit("update_weights")
            sender.update_weights(items)
            workers.collect()
            workers.submit("finish_weight_update")
            sender.finish_weight_update()
            workers.collect()
            assert workers.call("generate", [[5, 6]], 3) == [ReferenceEngine.from_checkpoint(qwen3_b).generate([[5, 6]], 3)]
        finally:
            sender.close()
