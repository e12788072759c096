"""Weight updates into offloaded models across processes: AllGather dp=2 over gloo, and transports."""

from __future__ import annotations

import pytest

from tests.offload import _update_workers
from weight_sync.testing import run_distributed

DIT = {"num_blocks": 4, "hidden": 64, "heads": 4}


@pytest.mark.parametrize("rollback", [True, False])
def test_allgather_dp2_ranks_write_only_their_shard_and_serve_exactly_a_fresh_load(rollback: bool) -> None:
    results = run_distributed(_update_workers.allgather_update, 2, DIT, rollback)
    for r in results:
        assert r["differs_before"]
        assert r["equal_resident"] and r["equal_offloaded"] and r["fingerprint_equal"]
        assert r["equal_after_buckets"]
        # Host bytes per rank stay 1/dp of the blocks, and a stream in block order held one block of scratch.
        before, after = r["host_bytes"]
        assert before == after == r["host_bytes_end"]
        assert before * 2 <= r["block_bytes"] + 2 * 4 * 1024
        assert 0 < r["scratch_peak"] <= r["largest_block"]
        assert r["source_error"]
        if rollback:
            assert not r["torn"] and r["equal_after_failure"] is True
        else:
            assert r["torn"] and r["equal_after_failure"] == "refused"
        assert r["equal_after_recovery"]


@pytest.mark.parametrize(("backend", "quantization"), [("gloo", None), ("shm", None), ("gloo", "fp8_block")])
def test_a_transport_feeds_an_offloaded_engine_unchanged(backend: str, quantization: str | None) -> None:
    sender, engine = run_distributed(_update_workers.transport_into_offloaded, 2, backend, DIT, quantization)
    assert engine["equal"] and engine["version"] == 1
    assert engine["fingerprint"] == engine["fresh"]
    assert sender["fingerprints"] == [engine["fresh"]]


@pytest.mark.parametrize(("name", "rollback"), [("fp8_block", True), ("fp8", False)])
def test_allgather_dp2_quantized_ranks_requantize_and_keep_only_their_shard_of_a_fresh_quantized_load(
    name: str, rollback: bool
) -> None:
    dit = {"num_blocks": 3, "hidden": 160, "heads": 4}
    results = run_distributed(_update_workers.quantized_allgather_update, 2, dit, name, rollback)
    for r in results:
        assert r["differs_before"]
        assert r["shards_equal"] and r["shards_equal_after_buckets"]
        assert r["equal_resident"] and r["equal_offloaded"] and r["fingerprint_equal"]
        assert r["equal_a_after_buckets"] and r["equal_after_buckets"] and r["equal_first_buckets"]
        before, after = r["host_bytes"]
        assert before == after == r["host_bytes_end"]
        assert before * 2 <= r["block_bytes"] + 2 * 3 * 1024
        # No key list: every block's scratch waited for finish; with a manifest, a bucket's blocks.
        assert r["scratch_peak_no_keys"] == r["all_blocks"]
        assert 0 < r["scratch_peak_buckets"] <= 2 * r["largest_block"]  # a bucket spans <= 2 blocks
        assert r["source_error"]
        if rollback:
            assert not r["torn"] and r["equal_after_failure"] is True
        else:
            assert r["torn"] and r["equal_after_failure"] == "refused"
        assert r["equal_after_recovery"]
