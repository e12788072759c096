"""benchmarks/bench_async.py: the CI-sized CPU run ends to end, and its table agrees with its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_async.py"


def test_a_tiny_run_commits_every_staged_update_and_reports_pauses_against_one_copy(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "tiny", "--steps", "24", "--every", "8", "--repeats", "1",
         "--sources", "local", "--tag", "t", "--results-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads((tmp_path / "async_t.json").read_text())
    rows = {r["mode"]: r for r in payload["rows"]}
    assert set(rows) == {"none", "pause", "staged"}
    assert rows["none"]["updates"] == 0 and rows["none"]["pause_median_ms"] is None
    # Updates are due at tokens 8 and 16 of 24: both are applied (pause); staged, each is committed
    # during the run, skipped (the previous one still staging) or ready only after the last step.
    assert rows["pause"]["updates"] == 2
    staged = rows["staged"]
    assert staged["updates"] + staged["skipped"] + staged["late"] == 2 and staged["late"] <= 1
    assert payload["staging"]["num_bytes"] == payload["committed_bytes"] > 0
    for r in payload["runs"]:
        # Every sequence holds one span per version it saw: the first, and one per update of the run.
        assert max(r["spans_per_sequence"]) == 1 + r["updates"]
    md = (tmp_path / "async_t.md").read_text()
    assert f"| local | staged | {staged['tokens_per_s']:.1f} |" in md
    if staged["pause_vs_one_copy"] is not None:
        assert f"{staged['pause_vs_one_copy']:.2f}x |" in md
