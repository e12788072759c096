"""benchmarks/bench_peers.py: the CPU quick mode runs end to end and a failing phase still gives a table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_peers.py"


def _load_bench() -> Any:
    # Loaded under its own name, so spawned children (which import it by that name) find the same module.
    if "bench_peers" in sys.modules:
        return sys.modules["bench_peers"]
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module
    spec.loader.exec_module(module)
    return module


def _raises(q: Any) -> dict[str, Any]:
    q.put({"phase": "about to fail"})
    raise ValueError("engine exploded")


def _hangs(q: Any) -> dict[str, Any]:
    q.put({"phase": "waiting forever"})
    time.sleep(600)
    return {}


def test_quick_mode_writes_a_table_consistent_with_its_json(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--preset", "tiny", "--results-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads((tmp_path / "peers_cpu.json").read_text())
    table = (tmp_path / "peers_cpu.md").read_text()
    rows = {r["method"]: r for r in payload["rows"]}
    bound = payload["goals"]["bound_s"]
    assert bound == min(rows["bound: pinned H2D, one copy per tensor"]["seconds"],
                        rows["bound: pinned H2D, one contiguous copy"]["seconds"])
    for r in payload["rows"]:
        assert r["method"] in table
        if r["seconds"] is not None:
            assert abs(r["ratio_vs_bound"] - r["seconds"] / bound) < 1e-9
            assert f"| {r['seconds'] * 1e3:.1f} |" in table
    ours = rows["weight_sync begin_update + load (pinned host tensors)"]
    assert "manifest validation" in ours["checks"] and "pointer audit" in ours["checks"]
    assert "fingerprint OFF" in rows["weight_sync, fingerprint off"]["checks"]
    assert payload["local"]["weight_sync_fingerprint"] and payload["local"]["weight_sync_spot_check"]
    assert payload["local"]["weight_sync_nofp_fingerprint"] is None
    # The peer needs CUDA: on CPU its row is there, unmeasured, and says why.
    peer = next(r for r in payload["rows"] if r["method"].startswith("checkpoint-engine"))
    assert peer["seconds"] is None and "skipped on CPU" in peer["note"]
    assert payload["goals"]["ours_within_1.1x_bound"] in (True, False)
    assert "phase bound + weight_sync: ok" in proc.stdout


def test_a_failing_or_hanging_phase_is_reported_not_raised() -> None:
    bench = _load_bench()
    failed = bench._run_phase("fails", [(_raises, ())], timeout_s=120)
    assert not failed["ok"] and "engine exploded" in failed["error"]
    hung = bench._run_phase("hangs", [(_hangs, ())], timeout_s=15)  # spawn + import torch: seconds here
    assert not hung["ok"] and "timed out" in hung["error"] and "waiting forever" in hung["error"]


def test_rows_and_goals_name_the_reason_when_nothing_was_measured() -> None:
    bench = _load_bench()
    rows, goals = bench.build_rows({"ok": False, "error": "CUDA out of memory"},
                                   {"ok": False, "error": "timed out after 300 s in step 'peer: update 2/6'"})
    assert all(r["seconds"] is None for r in rows)
    assert any("CUDA out of memory" in r["note"] for r in rows)
    assert "peer: update 2/6" in rows[-1]["note"]
    assert goals == {"bound_s": None}
    md = bench.markdown({"env": {}, "rows": rows, "goals": goals, "local": {}, "peer": {}, "tag": "t",
                         "preset": "tiny", "repeats": 1, "warmup": 1, "device": "cuda"})
    assert "CUDA out of memory" in md and "not run" in md
