"""Fifty consecutive updates do not grow the processes: buffers, streams and groups are made once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.transport.harness import repeated_updates
from weight_sync.testing import run_distributed

# Native memory (allocator arenas, gloo and store buffers; Python objects stay flat under tracemalloc)
# settles over the first ~80 updates: +25 KB per update on both ranks, then flat within ~50 KB for the next
# hundred (2026-12-01, 200 updates over gloo). A leak keeps growing after that; a settling process does not.
WARMUP = 90
MEASURED = 50
NUM_UPDATES = WARMUP + MEASURED


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["gloo", pytest.param("shm", marks=pytest.mark.xfail(strict=False, reason=(
    "open: over shm the engine grew 2.2% over updates 90..140 in one of three fresh-clone CI runs "
    "(2026-12-01; the settling was measured over 200 updates on gloo only)")))])
def test_fifty_consecutive_updates_grow_rss_by_less_than_one_percent(backend: str, qwen3_a: Path, qwen3_b: Path) -> None:
    results = run_distributed(repeated_updates, 2, backend, str(qwen3_a), str(qwen3_b), NUM_UPDATES, timeout_s=600)
    for rank, r in enumerate(results):
        rss = r["rss"]
        assert len(rss) == NUM_UPDATES
        growth = (rss[-1] - rss[WARMUP - 1]) / rss[WARMUP - 1]
        assert growth <= 0.01, f"rank {rank}: RSS grew {growth:.2%} over updates {WARMUP}..{NUM_UPDATES}"
    fps = results[1]["fingerprints"]
    assert len(set(fps[0::2])) == 1 and len(set(fps[1::2])) == 1 and fps[0] != fps[1]
