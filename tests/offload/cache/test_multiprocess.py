"""The runtime cache across real processes: one publisher, shared pages, SIGKILLed writers, live readers."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch

from tests.offload.cache._workers import (
    TinyDiT,
    checkpoint_tensors,
    crash_worker,
    holder_worker,
    load,
    pss_kib,
    sharing_worker,
    write_checkpoint,
)
from weight_sync.cli import main as cli_main
from weight_sync.offload.cache import verify_entry
from weight_sync.offload.cache.root import CacheRoot

_CTX = mp.get_context("spawn")
_REPLY_TIMEOUT_S = 300  # a spawned worker imports torch; on a busy 2-core machine that can be slow
# 8 blocks x 4 MiB float32 (+ a few bytes): large next to per-process noise in PSS.
_SHARING_SIZES = {"num_blocks": 8, "block_elems": 1 << 20}


def _recv(conn: Connection, what: str) -> tuple:
    if not conn.poll(_REPLY_TIMEOUT_S):
        raise AssertionError(f"no reply from worker while waiting for {what}")
    return conn.recv()


def _one_copy_kib(sizes: dict) -> float:
    return sum(t.numel() * t.element_size() for t in checkpoint_tensors(**sizes).values()) / 1024


def _run_sharing(tmp_path: Path, *, num_procs: int, use_cache: bool) -> tuple[list[tuple], float]:
    """Start workers, load in all at once, and return their reports and the summed PSS growth (KiB)."""
    ckpt = write_checkpoint(tmp_path / "ckpt" / "model.safetensors", **_SHARING_SIZES)
    cache = tmp_path / "cache"
    procs, conns = [], []
    try:
        for _ in range(num_procs):
            parent, child = _CTX.Pipe()
            p = _CTX.Process(target=sharing_worker, args=(child, str(ckpt), str(cache), use_cache, _SHARING_SIZES))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        pids = [_recv(c, "ready")[1] for c in conns]
        # Baselines are taken once every worker exists, so shared-library pages are already split
        # num_procs ways in both readings and cancel out of the difference.
        before = {pid: pss_kib(pid) for pid in pids}
        for c in conns:
            c.send("go")
        reports = [_recv(c, "loaded") for c in conns]
        after = {pid: pss_kib(pid) for pid in pids}
        for c in conns:
            c.send("exit")
        for p in procs:
            p.join(timeout=_REPLY_TIMEOUT_S)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return reports, float(sum(after[p] - before[p] for p in pids))


def test_eight_processes_publish_one_entry_and_share_its_pages(tmp_path: Path) -> None:
    reports, pss_growth_kib = _run_sharing(tmp_path, num_procs=8, use_cache=True)

    statuses = sorted(r[1] for r in reports)
    assert statuses.count("published") == 1, [r[1:3] for r in reports]
    assert set(statuses) <= {"published", "mapped", "hit"}, [r[1:3] for r in reports]
    assert all(r[3] for r in reports), "every process sees the checkpoint's values"
    inode_sets = {tuple(r[4]) for r in reports}
    assert len(inode_sets) == 1, "all processes map the same files (same inodes)"
    (mapped,) = inode_sets
    assert mapped and all(path.endswith(".safetensors") for path, _ in mapped)
    assert len(os.listdir(tmp_path / "cache" / "entries")) == 1

    one_copy = _one_copy_kib(_SHARING_SIZES)
    print(f"8 processes with the cache: summed PSS growth {pss_growth_kib / one_copy:.3f}x one copy")
    assert pss_growth_kib <= 1.25 * one_copy, f"{pss_growth_kib:.0f} KiB vs one copy {one_copy:.0f} KiB"


def test_private_copies_cost_one_copy_per_process(tmp_path: Path) -> None:
    # The control for the test above: without the cache, the same measurement sees every copy.
    reports, pss_growth_kib = _run_sharing(tmp_path, num_procs=4, use_cache=False)
    assert all(r[1] == "private" and r[3] for r in reports)
    one_copy = _one_copy_kib(_SHARING_SIZES)
    assert pss_growth_kib >= 3.5 * one_copy, f"{pss_growth_kib:.0f} KiB vs one copy {one_copy:.0f} KiB"


@pytest.mark.parametrize("point", ["after_temp_write", "before_fsync", "before_rename", "after_rename"])
def test_writer_killed_at_each_point_never_exposes_a_partial_entry_and_the_next_writer_recovers(
    point: str, tmp_path: Path
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt" / "model.safetensors")
    cache = tmp_path / "cache"
    parent, child = _CTX.Pipe()
    writer = _CTX.Process(target=crash_worker, args=(child, str(ckpt), str(cache), point))
    writer.start()
    child.close()
    try:
        assert _recv(parent, point) == ("at", point)
        renamed = point == "after_rename"
        # The writer is frozen at the point, holding the layout lock: what does a reader see?
        assert len(os.listdir(cache / "entries")) == (1 if renamed else 0)
        assert len(os.listdir(cache / "tmp")) == (0 if renamed else 1)
        reader = TinyDiT()
        seen = load(reader, ckpt, cache, lock_timeout_s=0.05)
        if renamed:
            assert seen.status == "hit", "a renamed entry is complete and valid"
        else:
            assert seen.status == "fallback" and seen.reason.startswith("lock timeout"), seen.reason
        assert torch.equal(reader.blocks[0].weight, checkpoint_tensors()["blocks.0.weight"])
        seen.close()
        os.kill(writer.pid, signal.SIGKILL)
        writer.join(timeout=_REPLY_TIMEOUT_S)
        assert writer.exitcode == -signal.SIGKILL
    finally:
        if writer.is_alive():
            writer.kill()

    # The kernel dropped the dead writer's lock: the next writer needs no timeout to get it.
    module = TinyDiT()
    result = load(module, ckpt, cache, lock_timeout_s=1.0)
    assert result.status == ("hit" if renamed else "published"), result.reason
    assert os.listdir(cache / "tmp") == [], "the stale temp dir is removed"
    assert result.key is not None and verify_entry(CacheRoot.at(cache), result.key) is None
    assert torch.equal(module.blocks[3].weight, checkpoint_tensors()["blocks.3.weight"])
    result.close()


def test_eviction_refuses_an_entry_a_live_process_maps_and_removes_it_once_idle(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt" / "model.safetensors")
    cache = tmp_path / "cache"
    load(TinyDiT(), ckpt, cache).close()
    parent, child = _CTX.Pipe()
    holder = _CTX.Process(target=holder_worker, args=(child, str(ckpt), str(cache)))
    holder.start()
    child.close()
    try:
        assert _recv(parent, "holder status")[0] == "hit"
        assert cli_main(["cache", "evict", "--dir", str(cache), "--max-bytes", "0"]) == 1
        assert "in use by a live process" in capsys.readouterr().out
        assert len(os.listdir(cache / "entries")) == 1
        parent.close()  # the holder returns from recv() with EOF and exits, dropping its lease
        holder.join(timeout=_REPLY_TIMEOUT_S)
        assert holder.exitcode == 0
    finally:
        if holder.is_alive():
            holder.kill()
    assert cli_main(["cache", "evict", "--dir", str(cache), "--max-bytes", "0"]) == 0
    assert "1 entries removed" in capsys.readouterr().out
    assert os.listdir(cache / "entries") == [] and os.listdir(cache / "trash") == []
