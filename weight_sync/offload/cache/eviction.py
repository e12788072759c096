"""Listing, verifying and evicting cache entries; an entry some live process maps is never removed.

An entry is *in use* while any process holds a shared lease on its manifest (see ``entry.py``). Removal
takes, without blocking, the key's publisher lock (so no publication of that key is in flight) and an
exclusive lock on the manifest (so no reader maps it), then renames the entry into ``trash/`` (readers
stop finding it atomically) and deletes it. Either lock being busy means "keep it".
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from weight_sync.errors import CacheError, ConfigError
from weight_sync.offload.cache.entry import (
    map_entry,
    open_lease,
    read_manifest,
    validate_files,
    verify_tensors,
)
from weight_sync.offload.cache.entry_manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    parse_manifest,
)
from weight_sync.offload.cache.identity import LayoutIdentity
from weight_sync.offload.cache.locking import LockTimeout, acquire_exclusive, release, try_lock
from weight_sync.offload.cache.root import CacheRoot

__all__ = [
    "EntryInfo",
    "EvictionReport",
    "entry_in_use",
    "evict_entries",
    "list_entries",
    "remove_idle_entry",
    "verify_entry",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """One published entry as ``weight-sync cache ls`` shows it."""

    key: str
    path: Path
    nbytes: int
    created_unix_s: float | None
    last_used_unix_s: float
    in_use: bool
    description: str
    problem: str | None  # the manifest could not be read or parsed


@dataclass(frozen=True, slots=True)
class EvictionReport:
    """What :func:`evict_entries` removed, what it had to keep, and the bytes left."""

    removed: list[EntryInfo] = field(default_factory=list)
    kept_in_use: list[EntryInfo] = field(default_factory=list)
    remaining_bytes: int = 0
    removed_temp_dirs: int = 0


def entry_in_use(root: CacheRoot, key: str) -> bool:
    """True if a live process holds a lease on entry ``key`` (probed with a non-blocking exclusive lock)."""
    try:
        fd = os.open(root.entry_dir(key) / MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return not try_lock(fd, shared=False)
    finally:
        os.close(fd)


def _describe(material: object) -> str:
    if not isinstance(material, dict):
        return "?"
    try:
        layout = LayoutIdentity(**material["layout"]).describe()
    except (KeyError, TypeError, ValueError):
        layout = "layout=?"
    return f"{layout} transform={material.get('transform_id', '?')}"


def _dir_bytes(path: Path) -> int:
    total = 0
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            total += entry.stat(follow_symlinks=False).st_size
    return total


def list_entries(root: CacheRoot) -> list[EntryInfo]:
    """Every published entry, least recently used first."""
    out: list[EntryInfo] = []
    for key in root.entry_keys():
        path = root.entry_dir(key)
        try:
            nbytes = _dir_bytes(path)
            last_used = os.stat(path).st_mtime
        except FileNotFoundError:
            continue  # removed by a concurrent eviction
        created: float | None = None
        description = "?"
        problem: str | None = None
        try:
            with open(path / MANIFEST_NAME, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
            manifest = parse_manifest(raw, expect_key=key, source=str(path / MANIFEST_NAME))
            created = manifest.created_unix_s
            description = _describe(manifest.key_material)
        except (CacheError, OSError) as e:
            problem = str(e)
        out.append(
            EntryInfo(
                key, path, nbytes, created, last_used, entry_in_use(root, key), description, problem
            )
        )
    out.sort(key=lambda e: (e.last_used_unix_s, e.key))
    return out


def verify_entry(root: CacheRoot, key: str) -> str | None:
    """Fully validate entry ``key`` (manifest, file SHA-256, headers, per-tensor SHA-256); the problem or None."""
    lease = open_lease(root, key)
    if lease is None:
        return "entry vanished or is being evicted"
    try:
        manifest = read_manifest(lease, key)
        validate_files(lease.entry, manifest)
        verify_tensors(manifest, map_entry(lease.entry, manifest))
    except (CacheError, OSError) as e:
        return str(e)
    finally:
        lease.close()
    return None


def remove_idle_entry(root: CacheRoot, key: str) -> bool:
    """Remove entry ``key`` if no process maps or publishes it; False (entry kept) otherwise."""
    try:
        lock_fd = acquire_exclusive(root.lock_path(key), timeout_s=0, what=f"evict {key[:12]}")
    except LockTimeout:
        return False  # a publisher of this key is active
    try:
        path = root.entry_dir(key)
        try:
            fd = os.open(path / MANIFEST_NAME, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            if path.exists():  # no manifest: a broken entry nobody can lease, safe to remove
                root.discard(path)
            return True
        try:
            if not try_lock(fd, shared=False):
                return False
            # While we hold the exclusive lock no reader can take a lease; renaming the entry away
            # first means a reader that opened the manifest meanwhile fails its inode re-check.
            root.discard(path)
        finally:
            os.close(fd)
        return True
    finally:
        release(lock_fd)


def _remove_orphans(root: CacheRoot) -> int:
    """Remove temp dirs whose writer is gone (its key lock is free) and leftovers in trash/."""
    removed = 0
    for tmp in root.temp_dirs():
        key = tmp.name.split(".", 1)[0]
        try:
            lock_fd = acquire_exclusive(root.lock_path(key), timeout_s=0, what=f"clean {key[:12]}")
        except LockTimeout:
            continue  # its writer (or another) is alive
        try:
            removed += root.remove_stale_temp_dirs(key)
        finally:
            release(lock_fd)
    # trash/ only ever receives entries renamed away under an exclusive lock, so nothing maps them.
    for leftover in sorted(root.trash.iterdir()) if root.trash.exists() else []:
        shutil.rmtree(leftover)
        removed += 1
    return removed


def evict_entries(
    root: CacheRoot,
    *,
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    now_unix_s: float | None = None,
    dry_run: bool = False,
) -> EvictionReport:
    """Remove idle entries last used more than ``older_than_s`` ago, then least recently used ones
    until the cache holds at most ``max_bytes``. Entries in use are kept and reported."""
    if max_bytes is None and older_than_s is None:
        raise ConfigError("evict needs max_bytes and/or older_than_s, got neither")
    if max_bytes is not None and max_bytes < 0:
        raise ConfigError(f"max_bytes must be >= 0, got: {max_bytes}")
    if older_than_s is not None and older_than_s < 0:
        raise ConfigError(f"older_than_s must be >= 0, got: {older_than_s}")
    now = time.time() if now_unix_s is None else now_unix_s
    removed_temp = 0 if dry_run else _remove_orphans(root)
    entries = list_entries(root)
    total = sum(e.nbytes for e in entries)
    report = EvictionReport(removed_temp_dirs=removed_temp)

    def consider(info: EntryInfo) -> None:
        nonlocal total
        if info in report.removed or info in report.kept_in_use:
            return
        if info.in_use or (not dry_run and not remove_idle_entry(root, info.key)):
            report.kept_in_use.append(info)
            logger.info("keeping runtime-cache entry %s: in use by a live process", info.path)
            return
        report.removed.append(info)
        total -= info.nbytes

    if older_than_s is not None:
        for info in entries:
            if now - info.last_used_unix_s > older_than_s:
                consider(info)
    if max_bytes is not None:
        for info in entries:  # least recently used first
            if total <= max_bytes:
                break
            consider(info)
    return EvictionReport(report.removed, report.kept_in_use, total, removed_temp)
