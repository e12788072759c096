"""Deferred verification: checks run on the device while buckets keep flowing, are read back once per
call, and a bad bucket still fails the update on every rank before anything is committed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.harness import (
    faults_then_recovery,
    host_waits_per_update,
    source_fails_mid_call,
)
from weight_sync.testing import run_distributed


@pytest.mark.parametrize(("backend", "rollback"), [("gloo", True), ("shm", False)])
def test_a_flipped_byte_checked_before_load_fails_every_rank_and_loads_nothing_of_the_bucket(
    backend: str, rollback: bool, qwen3_a: Path, qwen3_b: Path
) -> None:
    results = run_distributed(faults_then_recovery, 3, backend, str(qwen3_a), str(qwen3_b), rollback, "before_load",
                              timeout_s=300)
    for rank, r in enumerate(results):
        assert dict(r["outcomes"])["checksum"] == "AgreedChecksumError", f"rank {rank}: {r['outcomes']}"
        assert dict(r["outcomes"])["clean"] == "ok", f"rank {rank}: {r['outcomes']}"
        assert "bucket 8" in r["messages"]["checksum"] and "nothing of it was loaded" in r["messages"]["checksum"]
    for rank, e in enumerate(results[1:], start=1):
        fp, torn, version = e["after_checksum"]
        assert version == "initial", f"rank {rank}: a bucket that failed its checksum must not commit"
        if rollback:
            assert fp == e["before"] and torn is None, f"rank {rank}"
        else:
            assert torn is not None and "ChecksumError" in torn, f"rank {rank}"
        assert e["final"] == e["fresh_b"] and e["torn_final"] is None


# test_faults runs the same scenario with the default (deferred) on the other combinations.
@pytest.mark.parametrize(("backend", "rollback"), [("gloo", False), ("shm", True)])
def test_a_flipped_byte_found_by_deferred_verification_names_the_bucket_and_commits_nothing(
    backend: str, rollback: bool, qwen3_a: Path, qwen3_b: Path
) -> None:
    results = run_distributed(faults_then_recovery, 3, backend, str(qwen3_a), str(qwen3_b), rollback, "deferred",
                              timeout_s=300)
    for rank, r in enumerate(results):
        message = r["messages"]["checksum"]
        assert dict(r["outcomes"])["checksum"] == "AgreedChecksumError", f"rank {rank}: {r['outcomes']}"
        # The error names the bucket and its tensors after the fact, and says what deferral means.
        assert "rank 1" in message and "bucket 8" in message and "model.layers." in message, message
        assert "were loaded (deferred verification), the update will not be committed" in message, message
    for rank, e in enumerate(results[1:], start=1):
        fp, torn, version = e["after_checksum"]
        assert version == "initial", f"rank {rank}: nothing of a failed update is committed"
        if rollback:
            assert fp == e["before"] and torn is None, f"rank {rank}: rolled back bitwise"
        else:
            assert torn is not None and "ChecksumError" in torn, f"rank {rank}: loaded bytes leave the model torn"
        assert e["final"] == e["fresh_b"] and e["torn_final"] is None and e["final_version"] == 14


@pytest.mark.parametrize(("backend", "rollback", "verify"),
                         [("gloo", True, "deferred"), ("shm", False, "deferred"), ("gloo", False, "before_load")])
def test_a_sender_whose_source_fails_mid_call_makes_every_rank_raise_and_commits_nothing(
    backend: str, rollback: bool, verify: str, qwen3_a: Path, qwen3_b: Path
) -> None:
    # gloo + deferred: receivers learn of the ABORT buckets only from the trailers read back at the end
    # of the call (and load their stale bytes meanwhile); shm learns it from READY; before_load per bucket.
    results = run_distributed(source_fails_mid_call, 3, backend, str(qwen3_a), str(qwen3_b), rollback, verify,
                              timeout_s=300)
    for rank, r in enumerate(results):
        (_, kind, message), clean = r["outcomes"]
        assert kind == "AgreedSourceError", f"rank {rank}: {r['outcomes']}"
        assert "rank 0 (sender)" in message and "injected trainer failure" in message, message
        assert clean[1] == "ok"
    for rank, e in enumerate(results[1:], start=1):
        after = e["after_failure"]
        assert after["version"] == "initial", f"rank {rank}: nothing committed"
        if rollback:
            assert after["rolled_back"] and after["torn"] is None, f"rank {rank}"
        else:
            assert after["torn"] is not None, f"rank {rank}: a partly written engine is torn, never mixed"
        assert e["final"] == e["fresh_b"] and e["version"] == "clean"


@pytest.mark.parametrize("backend", ["gloo", "shm"])
def test_deferred_verification_reads_the_device_once_per_call_and_before_load_once_per_bucket(
    backend: str, qwen3_a: Path, qwen3_b: Path
) -> None:
    calls = 3
    deferred, _ = run_distributed(host_waits_per_update, 2, backend, str(qwen3_a), str(qwen3_b), "deferred", calls,
                                  timeout_s=120)
    before, _ = run_distributed(host_waits_per_update, 2, backend, str(qwen3_a), str(qwen3_b), "before_load", calls,
                                timeout_s=120)
    assert deferred["num_buckets"] > 3 * calls
    assert deferred["receivers"][0]["readback"] == calls
    assert before["receivers"][0]["readback"] == before["num_buckets"]
    # The sender never reads device values back; its control messages are a constant per call
    # (start: header + status; each call: header + status; finish: header + one exchange, the
    # receivers having prepared their commit before it).
    for r in (deferred, before):
        assert r["sender"]["readback"] == 0
        assert r["sender"]["control"] == 2 + 2 * calls + 2
