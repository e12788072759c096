"""FSDP2 source on 2 gloo ranks: exact full weights from rank 0, lockstep, one block of memory, no hangs."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.fsdp_ranks import gather_all, sender_never_starts, sender_stops_early
from weight_sync.testing import run_distributed


def test_rank_zero_yields_exact_full_weights_in_block_order_with_one_block_gathered(qwen3_b: Path) -> None:
    r0, r1 = run_distributed(gather_all, 2, str(qwen3_b), timeout_s=240)
    assert r0["equal"] is True
    assert r0["names"] == r0["manifest"] == r1["manifest"]
    # Global shapes come from DTensor metadata, without gathering anything.
    assert r0["manifest_shapes"] == [r0["full_shapes"][n] for n in r0["manifest"]]
    for r in (r0, r1):
        assert 0 < r["peak"] <= r["largest_block"] < r["total_bytes"] / 2, r


def test_other_ranks_raise_instead_of_hanging_when_the_sending_rank_stops(qwen3_b: Path) -> None:
    r0, r1 = run_distributed(sender_stops_early, 2, str(qwen3_b), timeout_s=240)
    assert "stopped consuming weights" in r1["error"]
    assert r0["after"] == r1["after"] == 2.0


def test_other_ranks_raise_when_the_sending_rank_never_reads_the_source(qwen3_b: Path) -> None:
    _, r1 = run_distributed(sender_never_starts, 2, str(qwen3_b), timeout_s=240)
    assert "stopped consuming weights before block model.embed_tokens.weight" in r1["error"]
