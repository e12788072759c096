"""Reading an entry: a shared-lock lease, SHA-256 validation of its files, and zero-copy mapping.

Lease protocol: a reader opens ``entries/<key>/manifest.json`` and takes a *shared* ``flock`` on it for as
long as it maps the entry's files. Eviction takes an *exclusive* ``flock`` (non-blocking) on the same
file before renaming the entry away, so it can never remove an entry some live process maps; the kernel
drops a killed reader's lock. A reader that opened the manifest just before an eviction renamed it gets
its lock only afterwards, so it re-checks that the path still names the inode it locked.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from weight_sync.errors import CacheError, WeightSyncError
from weight_sync.offload.cache.entry_manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    EntryManifest,
    FileRecord,
    TensorRecord,
    parse_manifest,
)
from weight_sync.offload.cache.locking import try_lock
from weight_sync.offload.cache.root import CacheRoot
from weight_sync.safetensors_io import map_safetensors

__all__ = [
    "CacheLease",
    "map_entry",
    "open_lease",
    "read_manifest",
    "tensor_sha256",
    "validate_files",
    "verify_tensors",
]

logger = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 16 << 20
# How long a reader waits for an exclusive holder of an entry's manifest lock before treating the entry
# as absent (an eviction that wins renames it away; the reader's inode re-check then sees that).
_LEASE_WAIT_S = 1.0

# Leases hold raw descriptors that nothing closes implicitly: dropping the result object must not drop
# the lock while tensors still map the files. They end with close() or with the process.
_OPEN_LEASES: dict[int, CacheLease] = {}


@dataclass(eq=False)
class CacheLease:
    """A shared lock on one entry, held while its files are mapped; :meth:`close` releases it."""

    entry: Path
    _fd: int | None = field(repr=False)

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        if self._fd is None:
            raise CacheError(f"lease on {self.entry} is closed")
        return self._fd

    def close(self) -> None:
        """Release the shared lock. Tensors stay valid (Linux keeps mapped pages of removed files)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        _OPEN_LEASES.pop(id(self), None)
        os.close(fd)


def _wait_shared(fd: int) -> bool:
    """Take a shared lock, waiting briefly: an exclusive holder is an eviction (or an `ls` probe) that
    finishes in milliseconds, and giving up at once would turn a hit into a needless miss."""
    deadline = time.monotonic() + _LEASE_WAIT_S
    delay = 0.001
    while not try_lock(fd, shared=True):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.05)
    return True


def open_lease(root: CacheRoot, key: str) -> CacheLease | None:
    """Take a shared lease on entry ``key``; None if it does not exist or is being evicted right now."""
    entry = root.entry_dir(key)
    path = entry / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    keep = False
    try:
        if not _wait_shared(fd):
            return None
        # Eviction renames the entry out of entries/ while holding the exclusive lock; if that happened
        # between our open() and flock(), the locked inode is no longer the published entry.
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            return None
        keep = True
    finally:
        if not keep:
            os.close(fd)
    lease = CacheLease(entry, fd)
    _OPEN_LEASES[id(lease)] = lease
    return lease


def read_manifest(lease: CacheLease, key: str) -> EntryManifest:
    """Read and validate the manifest through the leased descriptor (the inode we hold the lock on)."""
    fd = lease.fileno()
    chunks: list[bytes] = []
    total = 0
    offset = 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        total += len(chunk)
        if total > MAX_MANIFEST_BYTES:
            break
    return parse_manifest(b"".join(chunks), expect_key=key, source=str(lease.entry / MANIFEST_NAME))


def _sha256_of_file(path: Path, nbytes: int) -> str:
    h = hashlib.sha256()
    # Hashing through a read-only mapping reads the page cache in place (no copy into a buffer), and
    # leaves the pages cached for the tensor mapping that follows.
    with (
        open(path, "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        memoryview(mm) as view,
    ):
        for start in range(0, nbytes, _HASH_CHUNK_BYTES):
            h.update(view[start : start + _HASH_CHUNK_BYTES])
    return h.hexdigest()


def _check_file(entry: Path, rec: FileRecord) -> None:
    # rec.name matched the fixed shard pattern in parse_manifest, so this join stays inside entry.
    path = entry / rec.name
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise CacheError(f"{path}: listed in the manifest but cannot be read: {e}") from e
    if size != rec.nbytes:
        raise CacheError(f"{path}: manifest expects {rec.nbytes} bytes, found {size}")
    digest = _sha256_of_file(path, size)
    if digest != rec.sha256:
        raise CacheError(
            f"{path}: SHA-256 mismatch (manifest {rec.sha256[:16]}..., file {digest[:16]}...); "
            f"the entry is corrupt"
        )


def validate_files(entry: Path, manifest: EntryManifest) -> None:
    """Check every shard's size and full-content SHA-256 against the manifest; raise naming a bad file.

    Shards are hashed on parallel threads (hashlib releases the GIL on large buffers): the hash pass is
    the main cost of a cache hit, and each shard's digest is independent.
    """
    workers = max(1, min(len(manifest.files), os.cpu_count() or 1))
    if workers == 1:
        for rec in manifest.files:
            _check_file(entry, rec)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-sha256") as pool:
        # list() re-raises the first failure in manifest order once all hashes have finished.
        list(pool.map(lambda rec: _check_file(entry, rec), manifest.files))


def map_entry(entry: Path, manifest: EntryManifest) -> dict[str, torch.Tensor]:
    """Map every tensor of the entry zero-copy; headers must agree with the manifest exactly."""
    by_file: dict[str, list[TensorRecord]] = {}
    for rec in manifest.tensors:
        by_file.setdefault(rec.file, []).append(rec)
    out: dict[str, torch.Tensor] = {}
    for frec in manifest.files:
        path = entry / frec.name
        try:
            mapped = map_safetensors(path)
        except WeightSyncError as e:
            raise CacheError(f"{path}: cannot map cached shard: {e}") from e
        expected = {r.name: r for r in by_file.get(frec.name, [])}
        if set(mapped) != set(expected):
            extra = sorted(set(mapped) - set(expected))[:3]
            missing = sorted(set(expected) - set(mapped))[:3]
            raise CacheError(
                f"{path}: header tensors disagree with the manifest (extra {extra}, missing {missing})"
            )
        for name, t in mapped.items():
            rec = expected[name]
            if t.dtype != rec.dtype or tuple(t.shape) != rec.shape:
                raise CacheError(
                    f"{path}: tensor {name!r} is {tuple(t.shape)} {t.dtype} in the header, "
                    f"manifest says {rec.shape} {rec.dtype}"
                )
            # map_safetensors copies a misaligned tensor; a private copy would defeat page sharing.
            if t.numel() and t.untyped_storage().nbytes() != frec.nbytes:
                raise CacheError(f"{path}: tensor {name!r} is not aligned for a zero-copy view")
            out[name] = t
    return out


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a contiguous CPU tensor's bytes (the digest recorded per tensor in a manifest)."""
    data = t.detach().reshape(-1).view(torch.uint8).numpy()
    h = hashlib.sha256()
    view = memoryview(data)  # type: ignore[arg-type]
    for start in range(0, len(view), _HASH_CHUNK_BYTES):
        h.update(view[start : start + _HASH_CHUNK_BYTES])
    return h.hexdigest()


def verify_tensors(manifest: EntryManifest, mapped: dict[str, torch.Tensor]) -> None:
    """Check each mapped tensor's SHA-256 against its manifest record (the full check ``verify`` runs)."""
    for rec in manifest.tensors:
        digest = tensor_sha256(mapped[rec.name])
        if digest != rec.sha256:
            raise CacheError(
                f"{rec.file}: tensor {rec.name!r} SHA-256 mismatch (manifest {rec.sha256[:16]}..., "
                f"data {digest[:16]}...)"
            )
