"""send() folds the finish into its call: receivers running the whole update vote on the commit in the
call's status exchange, one round trip less, with the same all-or-none commit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.harness import folded_finish
from weight_sync.testing import run_distributed

ZERO_COPY = {"zero_copy": True, "checksum": False}


@pytest.mark.parametrize(("backend", "config"), [("gloo", None), ("shm", None), ("shm", ZERO_COPY)],
                         ids=["gloo", "shm", "shm-zero-copy"])
def test_send_to_receivers_that_run_the_whole_update_commits_in_the_call_exchange(
        backend: str, config: dict | None, qwen3_a: Path, qwen3_b: Path) -> None:
    trainer, *engines = run_distributed(folded_finish, 3, backend, str(qwen3_a), str(qwen3_b), None, None, config,
                                        timeout_s=300)
    assert [o for o, _ in trainer["outcomes"]] == ["ok", "ok", "ok"], trainer["outcomes"]
    # start (header + status) and the call (header + status): no finish header, no finish exchange.
    assert trainer["controls"] == [4, 4, 4]
    assert trainer["outcomes"][2][1] == "3,3"  # every receiver's own report reaches the trainer
    for rank, e in enumerate(engines, start=1):
        assert [o for o, _ in e["outcomes"]] == ["ok", "ok", "ok"], f"rank {rank}: {e['outcomes']}"
        assert [(fp, v) for fp, v, _ in e["after"]] == [
            (e["fresh"]["b"], 1), (e["fresh"]["a"], 2), (e["fresh"]["a"], 3)], f"rank {rank}"


def test_a_receiver_driving_its_own_finish_makes_the_others_wait_for_the_finish_header(
        qwen3_a: Path, qwen3_b: Path) -> None:
    trainer, *engines = run_distributed(folded_finish, 3, "gloo", str(qwen3_a), str(qwen3_b), 2, None, None,
                                        timeout_s=300)
    assert [o for o, _ in trainer["outcomes"]] == ["ok", "ok", "ok"], trainer["outcomes"]
    assert trainer["controls"] == [6, 6, 6]
    for rank, e in enumerate(engines, start=1):
        assert [(fp, v) for fp, v, _ in e["after"]] == [
            (e["fresh"]["b"], 1), (e["fresh"]["a"], 2), (e["fresh"]["a"], 3)], f"rank {rank}"


@pytest.mark.parametrize("explicit_rank", [None, 2], ids=["all-folded", "one-explicit"])
def test_a_commit_that_one_receiver_cannot_prepare_commits_nowhere(explicit_rank: int | None, qwen3_a: Path,
                                                                   qwen3_b: Path) -> None:
    trainer, *engines = run_distributed(folded_finish, 3, "gloo", str(qwen3_a), str(qwen3_b), explicit_rank, 1,
                                        None, timeout_s=300)
    outcome, message = trainer["outcomes"][1]
    assert outcome != "ok" and "rank 1 in finish_weight_update" in message and "refuses this update" in message
    assert trainer["outcomes"][2][0] == "ok"
    for rank, e in enumerate(engines, start=1):
        assert e["outcomes"][1][0] == outcome, f"rank {rank}: every rank raises the same agreed error"
        fp, version, torn = e["after"][1]
        # Rolled back everywhere, the receiver whose own commit was ready included.
        assert (fp, version, torn) == (e["fresh"]["b"], 1, None), f"rank {rank}"
        assert e["after"][2][:2] == (e["fresh"]["a"], 3), f"rank {rank}"
