"""``weight-sync offload-demo``: the seed's flags, ``--verify`` and the exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from weight_sync.cli import main


def test_offload_demo_verify_passes_and_prints_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["offload-demo", "--device", "cpu", "--verify", "--dlo-no-use-allgather",
               "--num-blocks", "3", "--hidden", "64", "--tokens", "16", "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out.splitlines()[0])
    assert result["bitwise_equal"] is True
    assert result["metrics"]["num_slots_allocated"] == 2
    assert result["metrics"]["num_call_agreements"] == 0  # no gather, so nothing to agree on
    assert "bitwise equal to resident on every rank" in out


def test_offload_demo_exits_non_zero_when_outputs_differ(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import weight_sync.offload.cli as demo

    real = demo._demo_rank

    def corrupted(rank: int, world: int, opts: dict) -> dict:
        result = real(rank, world, opts)
        result["bitwise_equal"] = False  # what a wrong slot copy would report
        return result

    monkeypatch.setattr(demo, "_demo_rank", corrupted)
    rc = main(["offload-demo", "--device", "cpu", "--verify", "--num-blocks", "2", "--hidden", "32",
               "--tokens", "8", "--steps", "1"])
    assert rc == 1
    assert "FAILED" in capsys.readouterr().out


def test_offload_demo_with_allgather_spawns_ranks_and_writes_traces(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "weight_sync.cli", "offload-demo", "--device", "cpu", "--verify",
         "--enable-distributed-layerwise-offload", "--data-parallel-size", "2", "--num-blocks", "3",
         "--hidden", "64", "--tokens", "16", "--steps", "2", "--checkpoint", str(tmp_path / "ckpt"),
         "--trace", str(trace)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["bitwise_equal"] and r["host_weights"] == "checkpoint_mmap"
        assert r["metrics"]["gather_group_size"] == 2
        # The warm-up and the timed generate each went through the call guard, once per call.
        assert r["metrics"]["num_call_agreements"] == 2
        spans = json.loads(Path(r["trace_file"]).read_text())
        assert {s["kind"] for s in spans} == {"compute", "h2d", "allgather"}
