"""``weight-sync demo --async``: rollouts generated while the last weights are staged, verified every step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainers.demo import DemoConfig, run_demo


def test_the_async_demo_passes_every_fingerprint_check_with_rollouts_at_most_one_step_stale(tmp_path: Path) -> None:
    results = run_demo(DemoConfig(steps=3, transport="inproc", asynchronous=True, out_dir=tmp_path))
    assert [r.fingerprint_match for r in results] == [None, True, True]
    # Step 1 samples the initial checkpoint, which is the trainer's own version: nothing is stale. Later
    # rollouts hold tokens of the version before the trainer's (staged while they were generated) and
    # possibly of the trainer's (committed mid-rollout), never older.
    assert results[0].staleness_max == 0
    assert all(r.staleness_max in (0, 1) for r in results)
    assert all(r.staleness_mean is not None and 0 <= r.staleness_mean <= 1 for r in results)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [s["staleness_max"] for s in saved["steps"]] == [r.staleness_max for r in results]


def test_the_async_demo_is_refused_with_engines_in_other_processes() -> None:
    with pytest.raises(ValueError, match="asynchronous needs transport 'inproc'"):
        DemoConfig(asynchronous=True, transport="gloo")
