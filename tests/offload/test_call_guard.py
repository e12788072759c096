"""The call guard: AllGather ranks agree on each pipeline call before its first gather, or all raise."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.offload import _workers
from weight_sync.offload.call_guard import _mismatch_message, describe_call
from weight_sync.testing import run_distributed


def test_equal_step_counts_run_bitwise_equal_to_resident_with_one_agreement_per_pipeline_call() -> None:
    for r in run_distributed(_workers.guarded_call, 2, [3, 3], [16, 16]):
        assert r["error"] == ""
        assert r["equal"]
        assert r["agreements"] == 1  # one pipeline call of 3 steps x 3 blocks: one agreement
        assert r["agreements_after_corrected"] == 2
        assert r["corrected_equal"] and r["equal_after_disable"]


@pytest.mark.parametrize(
    ("steps", "tokens", "named"),
    [
        ([3, 4], [16, 16], "num_inference_steps: rank 0: 3, rank 1: 4"),
        ([3, None], [16, 16], "num_inference_steps: rank 0: 3, rank 1: None"),
        ([2, 2], [16, 24], "latents: rank 0: tensor float32 [1, 16, 16], rank 1: tensor float32 [1, 24, 16]"),
    ],
    ids=["unequal_steps", "none_on_one_rank", "unequal_shapes"],
)
def test_a_mismatched_call_raises_the_same_error_on_every_rank_before_any_load(
    steps: list[int | None], tokens: list[int], named: str
) -> None:
    results = run_distributed(_workers.guarded_call, 2, steps, tokens, timeout_s=120)
    assert results[0]["error"] == results[1]["error"]
    for r in results:
        assert named in r["error"]
        assert "before its first AllGather" in r["error"]
        assert r["loads_queued"] == 0
        assert r["seconds"] < r["timeout_s"]
        assert r["agreements"] == 0
        # Nothing was transferred, so the group is still in step: a call made alike is agreed and works.
        assert r["agreements_after_corrected"] == 1
        assert r["corrected_equal"] and r["equal_after_disable"]


def test_none_steps_on_every_rank_are_rejected_on_every_rank() -> None:
    results = run_distributed(_workers.guarded_call, 2, [None, None], [16, 16], timeout_s=120)
    assert results[0]["error"] == results[1]["error"]
    for r in results:
        assert "num_inference_steps is None on every rank" in r["error"]
        assert r["loads_queued"] == 0


def test_a_call_its_peer_never_makes_times_out_without_queuing_a_load_and_the_guard_then_refuses() -> None:
    # Per-step transformer calls (the DiT, not the pipeline, is what the user calls): rank 1 calls once more.
    calls_ok, extra = run_distributed(_workers.missing_peer_call, 2, [2, 3], timeout_s=120)
    assert calls_ok["error"] == "" and calls_ok["agreements"] == 2
    assert extra["agreements"] == 2
    assert "DLO agreement on the call 'transformer'" in extra["error"]
    assert extra["seconds"] < extra["timeout_s"] + 5.0
    assert extra["loads_queued"] == 0
    assert len(extra["refusals"]) == 2  # the retry and disable()
    assert all("refuses further calls" in m for m in extra["refusals"])


def test_the_record_binds_defaults_and_keeps_tensor_values_and_rank_local_args_out() -> None:
    def forward(latents: torch.Tensor, *, num_inference_steps: int = 28, seed: int = 0,
                device: torch.device | None = None) -> None: ...

    sig = inspect.signature(forward)
    a = describe_call(sig, (torch.zeros(1, 4),), {"seed": 1, "device": torch.device("cpu", 0)},
                      rank_local=("seed",))
    b = describe_call(sig, (torch.ones(1, 4),), {"seed": 2, "device": torch.device("cpu", 1)},
                      rank_local=("seed",))
    assert a == b
    assert dict(a)["num_inference_steps"] == "28"  # the default is part of the call
    assert describe_call(sig, (torch.zeros(1, 4),), {"num_inference_steps": 4}) != a


def test_a_mismatch_of_loads_already_issued_says_the_ranks_drifted() -> None:
    records = [[["called module", "Pipe"], ["loads before", "6"]], [["called module", "Pipe"], ["loads before", "7"]]]
    message = _mismatch_message([0, 1], records)
    assert "loads before: rank 0: 6, rank 1: 7" in message
    assert "already differ from an earlier call" in message
