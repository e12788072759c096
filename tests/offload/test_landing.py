"""Landing buffers (``dlo_landing_buffers``) for AllGather: each shard is copied into one of two device
landing buffers and gathered out of place into the slot; outputs stay bitwise equal (2 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.offload import _workers
from weight_sync.errors import ConfigError
from weight_sync.offload import OffloadConfig, enable_layerwise_offload
from weight_sync.testing import run_distributed
from weight_sync.testing.dit import DiTConfig, SyntheticDiTPipeline


def test_landing_mode_allocates_two_slots_and_two_landing_buffers_of_one_shard_each() -> None:
    results = run_distributed(_workers.landing_equal, 2, {"num_blocks": 4, "hidden": 96}, {}, 2)
    for r in results:
        m = r["metrics"]
        assert m["num_slots_allocated"] == 2
        assert m["num_landing_buffers_allocated"] == 2 and r["num_landing_buffers"] == 2
        assert m["landing_bytes"] * 2 == m["slot_bytes"]  # one shard of the (padded) largest block
        assert r["weights_only_in_slots"]  # blocks compute from the slots, never the landing buffers


def test_landing_mode_gathers_out_of_place_from_the_landing_buffers_and_restores_in_place() -> None:
    for r in run_distributed(_workers.landing_equal, 2, {"num_blocks": 3}, {}, 2):
        assert r["num_streamed_gathers"] in (12, 13)  # 2 calls x 2 steps x 3 blocks (+ a prefetch)
        assert r["streamed_gathers_out_of_place"]
        assert r["num_restore_gathers"] == 3  # handle.disable(): one in-place gather per block
        assert r["restore_gathers_in_place"]


def test_landing_buffers_over_the_usp_group_when_data_parallel_size_is_one() -> None:
    opts = {"data_parallel_size": 1, "usp": 2}
    for r in run_distributed(_workers.landing_equal, 2, {"num_blocks": 3}, opts, 2):
        assert r["equal"] and r["streamed_gathers_out_of_place"]
        assert r["metrics"]["num_landing_buffers_allocated"] == 2


def test_landing_mode_that_differs_across_ranks_fails_fast_on_every_rank() -> None:
    for msg in run_distributed(_workers.mismatched_landing, 2, timeout_s=120):
        assert "transfer schedule differs" in msg
        assert "rank 0" in msg and "rank 1" in msg


@pytest.mark.parametrize("options", [{}, {"data_parallel_size": 2}, {"usp": 2}])
def test_landing_buffers_without_allgather_are_rejected_naming_the_flag(options: dict) -> None:
    with pytest.raises(ConfigError, match=r"dlo_landing_buffers=True requires dlo_use_allgather=True"):
        OffloadConfig(dlo_landing_buffers=True, dlo_use_allgather=False, **options)


def test_landing_buffers_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="dlo_landing_buffers must be a bool"):
        OffloadConfig(dlo_landing_buffers=1)  # type: ignore[arg-type]


def test_landing_buffers_are_off_by_default_and_not_a_command_line_flag() -> None:
    assert OffloadConfig().dlo_landing_buffers is False
    assert OffloadConfig.from_kwargs(dlo_landing_buffers=True).dlo_landing_buffers is True


def test_landing_buffers_with_a_gather_group_of_one_are_accepted_and_allocate_nothing() -> None:
    torch.manual_seed(0)
    ref = SyntheticDiTPipeline(DiTConfig(num_blocks=4)).eval()
    off = copy.deepcopy(ref)
    expected = ref.generate(tokens=16, num_inference_steps=3)
    handle = enable_layerwise_offload(
        off, enable_distributed_layerwise_offload=True, device="cpu", dlo_landing_buffers=True
    )
    assert handle.config.dlo_landing_buffers and not handle.config.allgather_active
    assert torch.equal(off.generate(tokens=16, num_inference_steps=3), expected)
    m = handle.metrics()
    assert m["num_slots_allocated"] == 2
    assert m["num_landing_buffers_allocated"] == 0 and m["landing_bytes"] == 0
    assert m["num_gathers"] == 0
    assert handle.streamer is not None and handle.streamer.landing == []
    handle.disable()
