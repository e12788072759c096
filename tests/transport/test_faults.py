"""Failures are agreed by every rank, never hang, and never leave an engine silently mixed."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from pathlib import Path

import pytest

from tests.transport.harness import engine_role, faults_then_recovery, sender_role
from weight_sync.testing import run_distributed

EXPECTED_CLASSES = {
    "checksum": "AgreedChecksumError",
    "engine_rejects_manifest": "AgreedManifestError",
    "source_disagrees": "AgreedManifestError",
    "receiver_load_fails": "TransportError",
    "clean": "ok",
}


@pytest.mark.parametrize(("backend", "rollback"), [("gloo", True), ("shm", False)])
def test_every_rank_raises_the_same_error_and_the_engines_roll_back_or_tear(
    backend: str, rollback: bool, qwen3_a: Path, qwen3_b: Path
) -> None:
    results = run_distributed(faults_then_recovery, 3, backend, str(qwen3_a), str(qwen3_b), rollback, timeout_s=300)
    for rank, r in enumerate(results):
        assert dict(r["outcomes"]) == EXPECTED_CLASSES, f"rank {rank}: {r['outcomes']}"
    for rank, e in enumerate(results[1:], start=1):
        fp, torn, version = e["after_checksum"]
        assert version == "initial", "a bucket that failed its checksum must not commit"
        if rollback:
            assert fp == e["before"] and torn is None, f"rank {rank}: rollback must restore bitwise"
        else:
            assert torn is not None and "ChecksumError" in torn, f"rank {rank}: written layers mark the model torn"
        # A manifest the engine rejects and a source that disagrees with its first tensor fail before any
        # write: nothing changes (a torn model stays torn, a rolled-back one stays as it was).
        assert e["after_manifest"] == (fp, torn)
        assert e["after_source"] == (fp, torn)
        # The load failure on rank 1 aborts every receiver's update, rank 2's included.
        if rollback:
            assert e["after_load"] == (e["before"], None), f"rank {rank}"
        else:
            assert e["after_load"][1] is not None, f"rank {rank}"
        # The same connection then carries a clean update that clears everything.
        assert e["final"] == e["fresh_b"] and e["torn_final"] is None and e["final_version"] == 14


def _run_sender_failure(mode: str, backend: str, qwen3_a: Path, qwen3_b: Path, timeout_s: float,
                        rollback: bool, engine_device: str = "cpu", num_receivers: int = 2) -> tuple[list[dict], float]:
    ctx = mp.get_context("spawn")
    results, addresses = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=sender_role, args=(backend, num_receivers, str(qwen3_b), timeout_s, mode, 7, addresses, results),
                         daemon=True)
    sender.start()
    engines = []
    try:
        for rank in range(1, num_receivers + 1):
            address = addresses.get(timeout=120)
            p = ctx.Process(target=engine_role, args=(address, rank, str(qwen3_a), rollback, results, engine_device),
                            daemon=True)
            p.start()
            engines.append(p)
        stopped_at, outcomes = None, {}
        deadline = time.monotonic() + 240
        while len(outcomes) < num_receivers and time.monotonic() < deadline:
            try:
                kind, rank, payload = results.get(timeout=5)
            except queue.Empty:
                continue
            if kind == "stopped":
                stopped_at = payload
            elif kind == "result":
                outcomes[rank] = payload
        assert len(outcomes) == num_receivers, f"receivers did not report: {outcomes}"
        assert stopped_at is not None
        return [outcomes[r] for r in range(1, num_receivers + 1)], stopped_at
    finally:
        for p in [sender, *engines]:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_a_sender_killed_mid_update_makes_every_receiver_raise_within_twice_the_timeout(
    backend: str, qwen3_a: Path, qwen3_b: Path
) -> None:
    timeout_s = 6.0
    outcomes, killed_at = _run_sender_failure("kill", backend, qwen3_a, qwen3_b, timeout_s, rollback=True)
    for o in outcomes:
        assert o["error"] in ("TransportError", "TransportTimeout"), o
        assert o["raised_at"] - killed_at <= 2 * timeout_s, o
        assert "rank 0" in o["message"] or "sender" in o["message"], o["message"]
        assert o["rolled_back"] and not o["torn"], "rollback=True must restore the engine bitwise"


@pytest.mark.parametrize("rollback", [True, False])
def test_a_sender_killed_between_two_calls_leaves_every_engine_rolled_back_or_torn_as_its_wait_fails(
    rollback: bool, qwen3_a: Path, qwen3_b: Path
) -> None:
    # The first call's seven tensors were written and agreed; the receiver then waits for the next
    # header. When that wait fails, the engine is already rolled back or torn (not left mid-update with
    # the first call's writes until the next start or close).
    timeout_s = 6.0
    outcomes, killed_at = _run_sender_failure("kill_between_calls", "gloo", qwen3_a, qwen3_b, timeout_s, rollback)
    for o in outcomes:
        assert o["error"] in ("TransportError", "TransportTimeout"), o
        assert o["raised_at"] - killed_at <= 2 * timeout_s, o
        if rollback:
            assert o["rolled_back"] and not o["torn"], o
        else:
            assert o["torn"] and not o["rolled_back"], o


def test_a_hung_sender_makes_every_receiver_time_out_and_tear_without_rollback(qwen3_a: Path, qwen3_b: Path) -> None:
    timeout_s = 4.0
    outcomes, hung_at = _run_sender_failure("hang", "gloo", qwen3_a, qwen3_b, timeout_s, rollback=False)
    for o in outcomes:
        assert o["error"] == "TransportTimeout", o
        assert o["raised_at"] - hung_at <= 2 * timeout_s, o
        assert "update_weights" in o["message"] and "rank 0" in o["message"], o["message"]
        # Seven tensors (the embedding and block 0) were loaded before the hang: the engine is torn.
        assert o["torn"] and not o["rolled_back"]
