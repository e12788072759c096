"""``weight-sync demo --delta`` over gloo: every step's engine equals a fresh load of the trainer's
weights, steps after the first go as deltas, and a misstated base is refused and sent in full."""

from __future__ import annotations

from pathlib import Path

import pytest

import trainers.demo
from trainers.demo import DemoConfig, run_demo
from weight_sync.cli import main

REFUSED_STEP = 3


@pytest.mark.parametrize("quantization", ["none", "fp8", "fp8_per_channel", "fp8_block", "int8"])
def test_every_delta_step_matches_a_fresh_engine_and_a_wrong_base_falls_back_to_full(
    quantization: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_sync = trainers.demo._sync

    def sync(config, trainer, engine, workers, sender, manifest, step):  # type: ignore[no-untyped-def]
        if step + 1 == REFUSED_STEP:
            sender._delta.version = "a version the engine never committed"
        return real_sync(config, trainer, engine, workers, sender, manifest, step)

    monkeypatch.setattr(trainers.demo, "_sync", sync)
    steps = 15 if quantization == "fp8_block" else 5
    results = run_demo(DemoConfig(steps=steps, lr=1e-5, delta=True, transport="gloo", out_dir=tmp_path,
                                  quantization=None if quantization == "none" else quantization))
    assert all(r.fingerprint_match for r in results)
    modes = [r.sync_mode for r in results]
    assert modes == ["full", "delta", "full", *["delta"] * (steps - 3)]
    full_bytes = results[0].sync_bytes
    # At lr 1e-5 few bf16 values move per Adam step: a delta is a small part of a full sync.
    assert all(r.sync_bytes < 0.5 * full_bytes for r in results if r.sync_mode == "delta")


def test_the_demo_command_takes_delta(tmp_path: Path) -> None:
    assert main(["demo", "--steps", "2", "--delta", "--lr", "1e-5", "--out", str(tmp_path)]) == 0


def test_delta_is_refused_for_the_in_process_engine() -> None:
    with pytest.raises(ValueError, match="buffered transport"):
        DemoConfig(delta=True, transport="inproc")
