"""A trainer process sends into reference engines in other processes, over gloo and shm, TP=1 and TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.harness import sync_end_to_end
from weight_sync.testing import run_distributed


@pytest.mark.parametrize("backend", ["gloo", "shm"])
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_weights_equal_a_fresh_load_after_each_update(backend: str, tp: int, qwen3_a: Path, qwen3_b: Path) -> None:
    results = run_distributed(sync_end_to_end, 1 + tp, backend, str(qwen3_a), str(qwen3_b), 3, timeout_s=240)
    trainer, engines = results[0], results[1:]
    assert trainer["versions"] == [1, 2, 3]
    assert min(trainer["buckets"]) > 3, "64 KiB buckets must cut the tiny model into several buckets"
    # Each report's times nest: the data phase lies within the update_weights calls (all calls of the
    # split update summed), which lie within start..commit.
    for data_s, call_s, update_s in trainer["timings"]:
        assert 0 < data_s <= call_s < update_s
    for rank, e in enumerate(engines, start=1):
        assert e["versions"] == [1, 2, 3], f"rank {rank}"
        # Each update's fingerprint equals a fresh load of the same checkpoint (bitwise kernel tensors).
        assert e["fingerprints"] == e["fresh"], f"rank {rank}"
        assert e["bitwise_equal"], f"rank {rank}"
        # The sender's report carries every receiver's fingerprint, in rank order.
        assert [fps[rank - 1] for fps in trainer["fingerprints"]] == e["fingerprints"]
    assert len({tuple(map(tuple, e["tokens"])) for e in engines}) == 1  # TP ranks agree on generation
