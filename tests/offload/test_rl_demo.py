"""``weight-sync offload-demo --rl``: the served policy learns and equals a fresh resident load each step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weight_sync.cli import main

SMALL = ["--device", "cpu", "--num-blocks", "3", "--hidden", "64", "--tokens", "16", "--steps", "2",
         "--timeout", "300"]


def _lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("flags", [["--dlo-no-use-allgather"], ["--data-parallel-size", "2"],
                                   ["--dlo-no-use-allgather", "--quantization", "fp8_block"]],
                         ids=["no-allgather", "allgather-dp2", "fp8-streamed"])
def test_rl_demo_improves_the_reward_and_every_served_output_equals_a_fresh_resident_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    png = tmp_path / "reward.png"
    rc = main(["offload-demo", "--rl", "--rl-steps", "4", "--rl-png", str(png), *SMALL, *flags])
    lines = _lines(capsys.readouterr().out)
    steps, summary = lines[:-1], lines[-1]
    assert rc == 0
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(s["equal_to_fresh_resident"] for s in steps)
    assert summary["improved"] and summary["reward_last"] > summary["reward_first"]
    assert all(e["num_updates"] == 4 for e in summary["engine"])
    if "--data-parallel-size" in flags:  # each engine rank holds half of the blocks' bytes
        assert all(2 * e["host_bytes"] <= e["block_bytes"] + 4096 for e in summary["engine"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rl_demo_exits_non_zero_when_the_served_output_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import weight_sync.offload.rl_demo as rl

    # Only the trainer's oracle digest is altered (the engine runs in spawned processes): what an engine
    # serving other weights than the trainer's would look like.
    monkeypatch.setattr(rl, "_digest", lambda x: "not the served bytes")
    rc = main(["offload-demo", "--rl", "--rl-steps", "2", "--rl-png", str(tmp_path / "r.png"), *SMALL,
               "--dlo-no-use-allgather"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out and not _lines(out)[0]["equal_to_fresh_resident"]
