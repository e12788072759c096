"""load_with_runtime_cache in one process: hit/publish/mapped/fallback and what each leaves behind."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.offload.cache._workers import (
    LAYOUT,
    TRANSFORM,
    TinyDiT,
    checkpoint_tensors,
    copy_loader,
    load,
    write_checkpoint,
)
from weight_sync.errors import ConfigError
from weight_sync.offload.cache import _faults, load_with_runtime_cache
from weight_sync.offload.cache import root as root_mod
from weight_sync.offload.cache.eviction import entry_in_use
from weight_sync.offload.cache.locking import acquire_exclusive, release
from weight_sync.offload.cache.root import CacheRoot


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt" / "model.safetensors")


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def _assert_loaded(module: nn.Module) -> None:
    state = module.state_dict()
    for name, expected in checkpoint_tensors().items():
        assert torch.equal(state[name], expected), name


def _file_backed(t: torch.Tensor, under: Path) -> bool:
    """True if ``t``'s bytes lie in a mapping of a file below ``under`` (from /proc/self/maps)."""
    addr = t.data_ptr()
    prefix = os.path.realpath(under)
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return len(parts) == 6 and parts[5].strip().startswith(prefix)
    return False


def _leftovers(cache: Path) -> list[str]:
    return sorted(os.listdir(cache / "tmp")) + sorted(os.listdir(cache / "trash"))


def test_first_load_publishes_and_second_load_hits_without_calling_the_ordinary_loader(
    ckpt: Path, cache: Path
) -> None:
    first_calls: list[str] = []
    first = load(TinyDiT(), ckpt, cache, calls=first_calls)
    assert (first.status, first_calls) == ("published", ["ordinary_load"])

    module = TinyDiT()
    objects_before = {n: id(p) for n, p in module.named_parameters()}
    calls: list[str] = []
    result = load(module, ckpt, cache, calls=calls)

    assert result.status == "hit", result.reason
    assert calls == [] and not result.ordinary_load_called
    assert {n: id(p) for n, p in module.named_parameters()} == objects_before
    assert all(p.requires_grad for p in module.parameters())
    _assert_loaded(module)
    assert torch.equal(module.rope, torch.ones(5)), "non-persistent buffers are not cached"
    for name, t in module.state_dict().items():
        assert _file_backed(t, cache / "entries"), f"{name} is not backed by the cache entry"
    result.close()
    first.close()


def test_published_entry_is_plain_safetensors_in_a_0700_root(ckpt: Path, cache: Path) -> None:
    result = load(TinyDiT(), ckpt, cache)
    assert result.entry_dir is not None
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    shards = sorted(result.entry_dir.glob("shard-*.safetensors"))
    assert [s.name for s in shards] == ["shard-00000-of-00001.safetensors"]
    from_disk = load_file(str(shards[0]))
    assert from_disk.keys() == checkpoint_tensors().keys()
    assert all(torch.equal(from_disk[k], v) for k, v in checkpoint_tensors().items())
    manifest = json.loads((result.entry_dir / "manifest.json").read_text())
    assert {t["name"] for t in manifest["tensors"]} == set(checkpoint_tensors())
    assert all(len(t["sha256"]) == 64 for t in manifest["tensors"])
    assert manifest["key_material"]["layout"] == LAYOUT.to_json()
    result.close()


def test_small_max_shard_bytes_writes_several_shards_that_all_map(ckpt: Path, cache: Path) -> None:
    module = TinyDiT()
    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
        ordinary_load=copy_loader(module, ckpt), tensor_names=None, cache_dir=str(cache),
        lock_timeout_s=5, max_shard_bytes=20_000,
    )
    assert result.status == "published" and result.entry_dir is not None
    assert len(list(result.entry_dir.glob("shard-*"))) == 4
    hit_module = TinyDiT()
    hit = load(hit_module, ckpt, cache)
    assert hit.status == "hit", hit.reason
    _assert_loaded(hit_module)


def test_a_peer_entry_published_during_our_load_is_mapped_after_a_byte_comparison(
    ckpt: Path, cache: Path
) -> None:
    peer_results = []
    module = TinyDiT()
    ordinary = copy_loader(module, ckpt)

    def load_while_a_peer_publishes() -> None:
        peer_results.append(load(TinyDiT(), ckpt, cache))
        ordinary()

    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
        ordinary_load=load_while_a_peer_publishes, tensor_names=None, cache_dir=str(cache),
        lock_timeout_s=5,
    )
    assert peer_results[0].status == "published"
    assert result.status == "mapped", result.reason
    assert result.entry_dir == peer_results[0].entry_dir
    _assert_loaded(module)
    assert _file_backed(module.blocks[0].weight, cache / "entries")


def test_a_peer_entry_that_differs_from_our_loaded_bytes_is_refused(ckpt: Path, cache: Path) -> None:
    module = TinyDiT()
    ordinary = copy_loader(module, ckpt)

    def nondeterministic_load() -> None:
        peer = TinyDiT()
        load_with_runtime_cache(
            peer, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
            ordinary_load=lambda: (copy_loader(peer, ckpt)(), peer.norm.data.add_(1)),
            tensor_names=None, cache_dir=str(cache), lock_timeout_s=5,
        )
        ordinary()

    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
        ordinary_load=nondeterministic_load, tensor_names=None, cache_dir=str(cache), lock_timeout_s=5,
    )
    assert result.status == "fallback"
    assert "differs from this process's loaded weights" in result.reason and "'norm'" in result.reason
    _assert_loaded(module)
    assert not _file_backed(module.blocks[0].weight, cache)


def test_flipped_byte_fails_validation_keeps_ordinary_tensors_and_warns(
    ckpt: Path, cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    published = load(TinyDiT(), ckpt, cache)
    published.close()
    assert published.entry_dir is not None
    shard = published.entry_dir / "shard-00000-of-00001.safetensors"
    os.chmod(shard, 0o600)
    with open(shard, "r+b") as f:
        f.seek(os.path.getsize(shard) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    module = TinyDiT()
    calls: list[str] = []
    with caplog.at_level(logging.WARNING, logger="weight_sync.offload.cache"):
        result = load(module, ckpt, cache, calls=calls)

    assert result.status == "fallback" and calls == ["ordinary_load"]
    assert "SHA-256 mismatch" in result.reason and "removed" in result.reason
    assert any("SHA-256 mismatch" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    _assert_loaded(module)
    assert not _file_backed(module.blocks[0].weight, cache)
    assert not published.entry_dir.exists(), "an idle corrupt entry is removed"
    assert load(TinyDiT(), ckpt, cache).status == "published"


def test_lock_timeout_keeps_ordinary_tensors(ckpt: Path, cache: Path) -> None:
    key = load(TinyDiT(), ckpt, cache / "probe").key  # same key material, different root
    assert key is not None
    root = CacheRoot.at(cache)
    root.ensure()
    held = acquire_exclusive(root.lock_path(key), timeout_s=0, what="test holder")
    try:
        module = TinyDiT()
        result = load(module, ckpt, cache, lock_timeout_s=0.05)
    finally:
        release(held)
    assert result.status == "fallback" and result.reason.startswith("lock timeout")
    _assert_loaded(module)
    assert os.listdir(cache / "entries") == [] and _leftovers(cache) == []


def test_full_disk_keeps_ordinary_tensors_and_leaves_nothing_behind(
    ckpt: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(root_mod, "free_bytes", lambda path: 4096)
    module = TinyDiT()
    result = load(module, ckpt, cache)
    assert result.status == "fallback" and "found 4096 free" in result.reason
    _assert_loaded(module)
    assert os.listdir(cache / "entries") == [] and _leftovers(cache) == []


def test_disk_filling_up_mid_write_removes_the_temp_dir(ckpt: Path, cache: Path) -> None:
    def no_space(point: str) -> None:
        if point == "write_chunk":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    module = TinyDiT()
    with _faults.install(no_space):
        result = load(module, ckpt, cache)
    assert result.status == "fallback" and "No space left" in result.reason
    _assert_loaded(module)
    assert os.listdir(cache / "entries") == [] and _leftovers(cache) == []


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.empty(4, 4))
        self.head = self.embed


class _Strided(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 6).t())


class _Int8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4, dtype=torch.int8), requires_grad=False)


class _Aliased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        flat = torch.empty(32)
        self.a = nn.Parameter(flat[:16].view(4, 4))
        self.b = nn.Parameter(flat[16:].view(4, 4))
        self.register_buffer("whole", flat)


class _StaysOnMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4, device="meta"))


@pytest.mark.parametrize(
    ("module_cls", "expected"),
    [
        (_Tied, "tied tensors"),
        (_Strided, "non-contiguous"),
        (_Int8, "quantized layouts are not supported"),
        (_Aliased, "aliased tensors"),
        (_StaysOnMeta, "meta/device-only"),
    ],
)
def test_unsupported_layouts_keep_ordinary_tensors(
    module_cls: type[nn.Module], expected: str, ckpt: Path, cache: Path
) -> None:
    module = module_cls()
    calls: list[str] = []
    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
        ordinary_load=lambda: calls.append("ordinary_load"), tensor_names=None, cache_dir=str(cache),
        lock_timeout_s=5,
    )
    assert result.status == "fallback" and expected in result.reason, result.reason
    assert calls == ["ordinary_load"]
    assert not (cache / "entries").exists() or os.listdir(cache / "entries") == []


def test_meta_module_materialized_by_the_loader_is_published(ckpt: Path, cache: Path) -> None:
    with torch.device("meta"):
        module = TinyDiT()

    def materialize_and_load() -> None:
        module.to_empty(device="cpu")
        copy_loader(module, ckpt)()

    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
        ordinary_load=materialize_and_load, tensor_names=None, cache_dir=str(cache), lock_timeout_s=5,
    )
    assert result.status == "published", result.reason
    _assert_loaded(module)


def test_tensor_names_selects_a_subset_and_unknown_names_are_a_config_error(
    ckpt: Path, cache: Path
) -> None:
    module = TinyDiT()
    names = ["blocks.0.weight", "blocks.1.weight"]
    result = load_with_runtime_cache(
        module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
        ordinary_load=copy_loader(module, ckpt), tensor_names=names, cache_dir=str(cache),
        lock_timeout_s=5,
    )
    assert result.status == "published" and result.num_tensors == 2
    assert _file_backed(module.blocks[0].weight, cache) and not _file_backed(module.blocks[2].weight, cache)
    with pytest.raises(ConfigError, match=r"\['blocks.9.weight'\] are not parameters or persistent"):
        load_with_runtime_cache(
            module, checkpoint_files=[ckpt], transform_id=TRANSFORM, layout=LAYOUT,
            ordinary_load=copy_loader(module, ckpt), tensor_names=["blocks.9.weight"],
            cache_dir=str(cache), lock_timeout_s=5,
        )


def test_group_writable_cache_root_is_refused(ckpt: Path, cache: Path) -> None:
    cache.mkdir()
    os.chmod(cache, 0o777)
    module = TinyDiT()
    result = load(module, ckpt, cache)
    assert result.status == "fallback" and "must not be writable by group or others" in result.reason
    assert "found 0777" in result.reason
    _assert_loaded(module)


@pytest.mark.parametrize(("fstype", "words"), [("tmpfs", "memory-backed"), ("nfs4", "network filesystem")])
def test_cache_root_on_tmpfs_or_network_filesystem_logs_a_warning(
    fstype: str, words: str, ckpt: Path, cache: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/x {cache} {fstype} rw 0 0\n")
    monkeypatch.setattr(root_mod, "MOUNTS_PATH", mounts)
    monkeypatch.setattr(root_mod, "_WARNED_ROOTS", set())
    with caplog.at_level(logging.WARNING, logger="weight_sync.offload.cache"):
        assert load(TinyDiT(), ckpt, cache).status == "published"
    assert any(words in r.getMessage() and fstype in r.getMessage() for r in caplog.records)


def test_local_disk_root_logs_no_filesystem_warning(
    ckpt: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\n")
    monkeypatch.setattr(root_mod, "MOUNTS_PATH", mounts)
    monkeypatch.setattr(root_mod, "_WARNED_ROOTS", set())
    with caplog.at_level(logging.WARNING, logger="weight_sync.offload.cache"):
        assert load(TinyDiT(), ckpt, cache).status == "published"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_result_close_releases_the_lease(ckpt: Path, cache: Path) -> None:
    result = load(TinyDiT(), ckpt, cache)
    assert result.key is not None
    root = CacheRoot.at(cache)
    assert entry_in_use(root, result.key)
    result.close()
    assert not entry_in_use(root, result.key)
