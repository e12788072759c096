"""Zero-copy colocated transfer on CPU (shm): engines load from the trainer's own tensors in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.harness_zero_copy import (
    zero_copy_lifecycle,
    zero_copy_source_fails,
    zero_copy_split_calls,
)
from weight_sync.errors import ConfigError
from weight_sync.testing import run_distributed
from weight_sync.transport import TransportConfig


@pytest.mark.parametrize("tp", [1, 2])
def test_engines_load_the_trainers_tensors_in_place_and_each_storage_is_exported_once(
    tp: int, qwen3_a: Path, qwen3_b: Path
) -> None:
    results = run_distributed(zero_copy_lifecycle, 1 + tp, str(qwen3_a), str(qwen3_b), timeout_s=240)
    trainer, engines = results[0], results[1:]
    n = trainer["num_tensors"]
    exported = [s["exported"] for s in trainer["stats"]]
    # Update 1 exports every storage; the in-place step exports nothing; a replaced parameter and a
    # temporary are two new storages; the two-call update reuses everything.
    assert exported == [n, n, n + 2, n + 2]
    # Live regions: the replaced parameter's old storage is dropped at update 3, the temporary (alive
    # until after its update) at update 4.
    live = [s["regions"] for s in trainer["stats"]]
    assert live == [n, n, n + 1, n]
    for rank, e in enumerate(engines, start=1):
        assert e["fingerprints"] == e["fresh"], f"rank {rank}"
        assert [fps[rank - 1] for fps in trainer["fingerprints"]] == e["fingerprints"]
        assert e["regions"] == live, f"rank {rank} holds exactly the sender's live regions"
        assert e["bitwise_equal"], f"rank {rank}"
        # The trainer changed its tensors after the last update: the engine holds copies, not aliases.
        assert e["after_trainer_moved_on"] == e["fingerprints"][-1], f"rank {rank}"
        assert e["closed_regions"] == 0


def test_a_failing_source_rolls_the_engine_back_and_the_next_update_starts_from_fresh_exports(
    qwen3_a: Path, qwen3_b: Path
) -> None:
    trainer, engine = run_distributed(zero_copy_source_fails, 2, str(qwen3_a), str(qwen3_b), timeout_s=240)
    (_, t1, m1), (_, t2, m2), clean, again = trainer["outcomes"]
    # Every rank raises the sender's error (an "Agreed" subclass of it names the failing rank).
    assert t1.endswith("SourceError") and "injected trainer failure" in m1, (t1, m1)
    assert t2.endswith("ManifestError") and "float64" in m2, (t2, m2)
    assert clean[1] == again[1] == "ok", (clean, again)
    assert [o[1] for o in engine["outcomes"]] == [t1, t2, "ok", "ok"], engine["outcomes"]
    failing, wrong, after_clean, after_again = engine["after"]
    for a in (failing, wrong):
        assert a["rolled_back"] and a["torn"] is None, a
        assert a["regions"] == 0, "a failed call releases every import"
    assert after_clean["regions"] == after_again["regions"] == trainer["stats"]["regions"]
    assert engine["final"] == engine["fresh_b"]


def test_an_update_split_into_calls_from_a_lazy_source_equals_a_fresh_load(qwen3_a: Path, qwen3_b: Path) -> None:
    trainer, engine = run_distributed(zero_copy_split_calls, 2, str(qwen3_a), str(qwen3_b), 3, timeout_s=240)
    assert engine["fingerprint"] == engine["fresh"]
    assert trainer["fingerprints"] == [engine["fresh"]]
    assert trainer["num_buckets"] == 0, "zero-copy packs nothing"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"backend": "gloo", "zero_copy": True, "checksum": False}, "colocated backend"),
        ({"backend": "nccl", "zero_copy": True, "checksum": False}, "colocated backend"),
        ({"backend": "shm", "zero_copy": True}, "checksum=False"),
    ],
)
def test_zero_copy_is_rejected_where_it_cannot_work(kwargs: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        TransportConfig(**kwargs)
