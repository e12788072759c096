"""``weight-sync cache ls | verify | evict`` and the eviction rules behind them."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from tests.offload.cache._workers import LAYOUT, TRANSFORM, TinyDiT, copy_loader, write_checkpoint
from weight_sync.cli import main as cli_main
from weight_sync.offload.cache import (
    CacheRoot,
    RuntimeCacheResult,
    evict_entries,
    list_entries,
    load_with_runtime_cache,
)
from weight_sync.offload.cache import entry as entry_mod
from weight_sync.offload.cache.cli import parse_bytes, parse_duration
from weight_sync.offload.cache.entry import open_lease
from weight_sync.offload.cache.locking import acquire_exclusive, release, try_lock


def _publish(ckpt: Path, cache: Path, *, tp_rank: int = 0) -> RuntimeCacheResult:
    module = TinyDiT()
    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM,
        layout=dataclasses.replace(LAYOUT, tp_size=4, tp_rank=tp_rank),
        ordinary_load=copy_loader(module, ckpt), tensor_names=None, cache_dir=str(cache),
        lock_timeout_s=5,
    )
    assert result.status == "published", result.reason
    return result


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt" / "model.safetensors")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _set_last_used(result: RuntimeCacheResult, unix_s: float) -> None:
    assert result.entry_dir is not None
    os.utime(result.entry_dir, (unix_s, unix_s))


def test_ls_prints_one_line_per_entry_with_its_state(
    ckpt: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    idle = _publish(ckpt, cache, tp_rank=0)
    idle.close()
    busy = _publish(ckpt, cache, tp_rank=1)
    assert cli_main(["cache", "ls", "--dir", str(cache)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[-1].startswith("2 entries")
    by_key = {line.split()[0]: line for line in lines[:2]}
    assert "idle" in by_key[idle.key[:16]] and "tp=0/4" in by_key[idle.key[:16]]  # type: ignore[index]
    assert "in-use" in by_key[busy.key[:16]] and "tp=1/4" in by_key[busy.key[:16]]  # type: ignore[index]
    assert f"transform={TRANSFORM}" in lines[0]
    busy.close()


def test_verify_exits_nonzero_when_any_entry_is_corrupt(
    ckpt: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = _publish(ckpt, cache, tp_rank=0)
    bad = _publish(ckpt, cache, tp_rank=1)
    good.close()
    bad.close()
    assert cli_main(["cache", "verify", "--dir", str(cache)]) == 0
    capsys.readouterr()
    assert bad.entry_dir is not None
    shard = bad.entry_dir / "shard-00000-of-00001.safetensors"
    shard.chmod(0o600)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert cli_main(["cache", "verify", "--dir", str(cache)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  {bad.key[:16]}" in out and "SHA-256 mismatch" in out  # type: ignore[index]
    assert f"ok    {good.key[:16]}" in out  # type: ignore[index]


def test_evict_older_than_removes_only_entries_idle_for_longer(ckpt: Path, cache: Path) -> None:
    old = _publish(ckpt, cache, tp_rank=0)
    recent = _publish(ckpt, cache, tp_rank=1)
    old.close()
    recent.close()
    now = time.time()
    _set_last_used(old, now - 3 * 86400)
    _set_last_used(recent, now - 3600)
    report = evict_entries(CacheRoot.at(cache), older_than_s=parse_duration("2d"), now_unix_s=now)
    assert [e.key for e in report.removed] == [old.key]
    assert [e.key for e in list_entries(CacheRoot.at(cache))] == [recent.key]


def test_evict_max_bytes_removes_least_recently_used_idle_entries_first(
    ckpt: Path, cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = [_publish(ckpt, cache, tp_rank=r) for r in range(3)]
    now = time.time()
    for age, r in zip((100, 300, 200), results):
        r.close()
        _set_last_used(r, now - age)
    one = list_entries(CacheRoot.at(cache))[0].nbytes
    assert cli_main(["cache", "evict", "--dir", str(cache), "--max-bytes", str(one + 10)]) == 0
    remaining = [e.key for e in list_entries(CacheRoot.at(cache))]
    assert remaining == [results[0].key], "the two least recently used entries went first"
    assert "2 entries removed" in capsys.readouterr().out


def test_evict_dry_run_removes_nothing(ckpt: Path, cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _publish(ckpt, cache).close()
    assert cli_main(["cache", "evict", "--dir", str(cache), "--max-bytes", "0", "--dry-run"]) == 0
    assert "1 entries would remove" in capsys.readouterr().out
    assert len(list_entries(CacheRoot.at(cache))) == 1


def test_evict_removes_stale_temp_dirs_only_when_their_writer_is_gone(ckpt: Path, cache: Path) -> None:
    published = _publish(ckpt, cache)
    published.close()
    root = CacheRoot.at(cache)
    live_key, dead_key = "1" * 64, "2" * 64
    live_tmp, dead_tmp = root.new_temp_dir(live_key), root.new_temp_dir(dead_key)
    held = acquire_exclusive(root.lock_path(live_key), timeout_s=0, what="live writer")
    try:
        report = evict_entries(root, older_than_s=10 * 86400)
    finally:
        release(held)
    assert report.removed_temp_dirs == 1 and report.removed == []
    assert live_tmp.exists() and not dead_tmp.exists()


def test_an_entry_being_published_is_not_evicted(ckpt: Path, cache: Path) -> None:
    published = _publish(ckpt, cache)
    published.close()
    root = CacheRoot.at(cache)
    assert published.key is not None
    held = acquire_exclusive(root.lock_path(published.key), timeout_s=0, what="publisher")
    try:
        report = evict_entries(root, max_bytes=0)
    finally:
        release(held)
    assert report.removed == [] and [e.key for e in report.kept_in_use] == [published.key]


def test_evict_without_a_criterion_is_an_error(cache: Path) -> None:
    cache.mkdir(mode=0o700)
    with pytest.raises(SystemExit, match="needs max_bytes and/or older_than_s"):
        cli_main(["cache", "evict", "--dir", str(cache)])


@pytest.mark.parametrize(
    ("text", "value"), [("1024", 1024), ("500M", 500_000_000), ("2GiB", 2 << 30), ("1.5k", 1500)]
)
def test_sizes_parse_with_decimal_and_binary_units(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("text", "value"), [("90", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800)])
def test_durations_parse_with_units(text: str, value: float) -> None:
    assert parse_duration(text) == value


def test_a_reader_racing_an_eviction_treats_the_entry_as_absent(
    ckpt: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    published = _publish(ckpt, cache)
    published.close()
    assert published.entry_dir is not None and published.key is not None
    monkeypatch.setattr(entry_mod, "_LEASE_WAIT_S", 0.01)
    evictor = os.open(published.entry_dir / "manifest.json", os.O_RDONLY)
    try:
        assert try_lock(evictor, shared=False)  # an eviction holds the entry exclusively
        assert open_lease(CacheRoot.at(cache), published.key) is None
    finally:
        os.close(evictor)
    lease = open_lease(CacheRoot.at(cache), published.key)
    assert lease is not None, "once the evictor lets go (and the entry is still there) readers lease it"
    lease.close()
