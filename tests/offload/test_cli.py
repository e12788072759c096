"""``weight-sync offload-demo``: the seed's flags, ``--verify`` and the exit status."""

from __future__ import annotations

import json
import os
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


def test_offload_demo_verifies_quantized_streaming_against_the_resident_quantized_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc = main(["offload-demo", "--device", "cpu", "--verify", "--dlo-no-use-allgather", "--quantization",
               "fp8_block", "--dtype", "bfloat16", "--num-blocks", "3", "--hidden", "128", "--tokens", "16",
               "--steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    result = json.loads(out.splitlines()[0])
    assert result["bitwise_equal"] is True
    assert result["metrics"]["quantization"] == "fp8_block"
    assert result["metrics"]["num_quantized_linears"] == 12
    assert "bitwise equal to resident fp8_block on every rank" in out


def test_offload_demo_with_quantization_fails_against_an_unquantized_oracle(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import weight_sync.offload.cli as demo

    real = demo._resident_oracle
    monkeypatch.setattr(demo, "_resident_oracle", lambda pipe, quantization, device: real(pipe, None, device))
    rc = main(["offload-demo", "--device", "cpu", "--verify", "--dlo-no-use-allgather", "--quantization",
               "fp8", "--num-blocks", "2", "--hidden", "32", "--tokens", "8", "--steps", "1"])
    assert rc == 1
    assert "FAILED - offloaded output differs from resident fp8" in capsys.readouterr().out


def test_three_concurrent_demos_with_the_runtime_cache_share_one_checkpoint_and_one_entry(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}  # where the default checkpoint goes
    (tmp_path / "tmp").mkdir()
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "weight_sync.cli", "offload-demo", "--device", "cpu", "--dlo-no-use-allgather",
           "--dlo-enable-runtime-cache", "--dlo-runtime-cache-dir", str(cache), "--num-blocks", "2",
           "--hidden", "32", "--tokens", "8", "--steps", "1"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    results = []
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("{"))))
    assert all(r["host_weights"] == "runtime_cache" for r in results)
    statuses = sorted(r["cache_status"] for r in results)
    assert statuses.count("published") == 1 and set(statuses) <= {"published", "hit", "mapped"}
    assert len(list((cache / "entries").iterdir())) == 1
    assert len(list((tmp_path / "tmp").glob("weight-sync-offload-demo-*/*/model.safetensors"))) == 1


def test_demo_checkpoint_is_written_once_and_a_dead_writers_temp_file_is_removed(tmp_path: Path) -> None:
    from weight_sync.offload.demo_checkpoint import ensure_checkpoint

    stale = tmp_path / ".model.safetensors.999999.tmp"
    stale.write_bytes(b"half a file")
    calls: list[Path] = []

    def write(file: Path) -> None:
        calls.append(file)
        file.write_bytes(b"weights")

    final = ensure_checkpoint(tmp_path, write)
    assert final.read_bytes() == b"weights" and not stale.exists()
    identity = final.stat()
    assert ensure_checkpoint(tmp_path, write) == final
    assert len(calls) == 1 and final.stat().st_ino == identity.st_ino
    assert final.stat().st_mtime_ns == identity.st_mtime_ns
