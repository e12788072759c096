"""FSDPSource's per-block agreement has a deadline: a trainer rank that never reaches it is a timeout
naming the agreement on the others, not a hang."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.trainers.fsdp_ranks import _sharded_model
from trainers import FSDPSource
from weight_sync.errors import TransportTimeout
from weight_sync.testing import run_distributed

AGREE_TIMEOUT_S = 2.0


def one_rank_misses_the_first_agreement(rank: int, world: int, ckpt: str, late: int) -> dict:
    """Rank ``late`` gathers block 0 with the others but never enters its agreement; the other rank
    iterates (or participates) and must time out. Afterwards the late rank joins the pending all-reduce,
    so that both ranks leave the group matched."""
    model, _ = _sharded_model(ckpt)
    source = FSDPSource(model, agree_timeout_s=AGREE_TIMEOUT_S)
    store = dist.distributed_c10d._get_default_store()
    flag = torch.zeros(1, dtype=torch.int64)
    if rank == late:
        source._gather(source.blocks[0]).clear()  # the block's all-gathers, as on every rank
        store.wait(["test/timed_out"])  # the other rank's deadline passed
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the agreement the other rank gave up on
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return {}
    t0 = time.monotonic()
    error: dict = {"type": None}
    try:
        if rank == source.src_rank:
            for _ in source:
                pass
        else:
            source.participate()
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e)}
    elapsed = time.monotonic() - t0
    store.set("test/timed_out", "1")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return {**error, "elapsed": elapsed}


@pytest.mark.parametrize("late", [0, 1], ids=["the-sending-rank-is-late", "a-gathering-rank-is-late"])
def test_a_trainer_rank_that_never_reaches_the_agreement_times_the_others_out_naming_it(
    late: int, qwen3_b: Path
) -> None:
    results = run_distributed(one_rank_misses_the_first_agreement, 2, str(qwen3_b), late, timeout_s=240)
    waiting = results[1 - late]
    assert waiting["type"] == TransportTimeout.__name__, waiting
    assert "FSDPSource agreement before block model.embed_tokens.weight" in waiting["message"], waiting
    assert "expected all 2 trainer ranks within 2.0 s" in waiting["message"], waiting
    assert AGREE_TIMEOUT_S <= waiting["elapsed"] < 2 * AGREE_TIMEOUT_S + 2, waiting
