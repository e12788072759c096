"""AllGather mode on 2 gloo ranks: equal outputs, 1/dp host bytes, schedule agreement, votes, waves."""

from __future__ import annotations

import pytest

from tests.offload import _workers
from weight_sync.testing import run_distributed


# (worker, generate calls it makes): the landing worker generates twice (it also records its gathers).
@pytest.mark.parametrize(("worker", "calls"), [("allgather_equal", 1), ("landing_equal", 2)])
def test_allgather_dp2_output_is_bitwise_equal_to_resident_over_several_steps(worker: str, calls: int) -> None:
    results = run_distributed(getattr(_workers, worker), 2, {"num_blocks": 5}, {}, 3)
    for r in results:
        assert r["equal"]
        assert r["equal_after_disable"]
        m = r["metrics"]
        assert m["gather_group_size"] == 2
        assert m["num_block_loads"] == calls * 15  # 3 steps x 5 blocks per call
        # ... plus the prefetch of the next step's block 0, which may still be in flight.
        assert m["num_gathers"] in (calls * 15, calls * 15 + 1)
        assert m["fabric_bytes"] > 0


@pytest.mark.parametrize("worker", ["allgather_equal", "landing_equal"])
def test_allgather_host_bytes_per_rank_are_about_one_half_of_the_blocks(worker: str) -> None:
    # In place or through landing buffers, each rank holds and copies only its half.
    results = run_distributed(getattr(_workers, worker), 2, {"num_blocks": 4, "hidden": 96}, {}, 1)
    for r in results:
        m = r["metrics"]
        assert m["host_storage"] == "packed"
        assert 0.49 * m["block_bytes"] <= m["host_bytes"] <= 0.55 * m["block_bytes"]
        # Each rank copies its half over "PCIe" and receives the other half from its peer (the
        # prefetch of the next step's first block may have copied but not yet gathered).
        per_gather = m["fabric_bytes"] // m["num_gathers"]
        assert m["h2d_bytes"] in (m["num_gathers"] * per_gather, (m["num_gathers"] + 1) * per_gather)


def test_usp_group_gathers_when_data_parallel_size_is_one() -> None:
    opts = {"data_parallel_size": 1, "usp": 2}
    for r in run_distributed(_workers.allgather_equal, 2, {"num_blocks": 3}, opts, 2):
        assert r["equal"]
        assert r["metrics"]["gather_group_size"] == 2
        assert r["metrics"]["num_gathers"] > 0


def test_mismatched_schedule_digests_fail_fast_on_every_rank() -> None:
    messages = run_distributed(_workers.mismatched_schedule, 2, timeout_s=120)
    for msg in messages:
        assert "transfer schedule differs" in msg
        assert "rank 0" in msg and "rank 1" in msg


def test_pin_failure_on_one_rank_moves_every_rank_to_the_same_fallback() -> None:
    results = run_distributed(_workers.pin_failure_vote, 2)
    for r in results:
        assert r["equal"]
        m = r["metrics"]
        assert m["pinned_bytes"] == 0
        assert m["num_fallbacks"] == 1
        assert "pageable" in m["fallback_reasons"][0]
    assert "this rank" in results[1]["metrics"]["fallback_reasons"][0]
    assert "a peer" in results[0]["metrics"]["fallback_reasons"][0]


def test_dp_wave_runs_one_request_per_rank_in_lockstep() -> None:
    results = run_distributed(_workers.dp_wave, 2, [3, 3])
    assert [r["request"] for r in results] == ["req0", "req1"]
    assert all(r["equal"] for r in results)


@pytest.mark.parametrize("steps", [[3, 4], [None, 3]], ids=["unequal", "none"])
def test_unequal_or_missing_step_counts_are_rejected_before_any_collective(steps: list) -> None:
    results = run_distributed(_workers.dp_wave, 2, steps)
    for r in results:
        assert "num_inference_steps" in r["rejected"]
        assert r["gathers_before"] == r["gathers_after"] == 0
