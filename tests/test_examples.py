"""The runnable examples run end to end and print what their docstrings promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reload_multiply_add_answers_12_then_7_then_12_from_one_engine(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reload_multiply_add.py"), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    answers = [line.split("    ")[0] for line in out.stdout.splitlines() if line.startswith("3 4 = ")]
    assert answers == ["3 4 = 12", "3 4 = 7", "3 4 = 12"]
    assert "kept its address across reloads: True" in out.stdout
