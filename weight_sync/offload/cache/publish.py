"""Publishing an entry: sharded safetensors + manifest written to a temp dir, fsynced, renamed into place.

Crash safety comes from ordering, with the caller holding the key's publisher lock throughout:

1. stale temp dirs of this key are removed (their writers died: a live one would hold the lock);
2. free space is checked against the entry size plus headroom, before anything is written;
3. shards and the manifest are written into ``tmp/<key>.<pid>.<token>/``, which readers never look at;
4. every file, then the temp directory, is fsynced, so the data and the names are durable *before*
   the entry can become visible;
5. one ``rename(tmp, entries/<key>)`` publishes: readers see either no entry or a complete one;
6. ``entries/`` is fsynced so the rename itself survives a power loss.

A failure before step 5 removes the temp dir (a SIGKILL leaves it for the next writer, step 1).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from weight_sync.errors import CacheError
from weight_sync.offload.cache import _faults
from weight_sync.offload.cache import root as root_mod
from weight_sync.offload.cache.entry_manifest import (
    MANIFEST_NAME,
    EntryManifest,
    FileRecord,
    TensorRecord,
    shard_name,
)
from weight_sync.offload.cache.identity import CacheKey
from weight_sync.offload.cache.root import CacheRoot, fsync_dir

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DISK_HEADROOM_BYTES",
    "InsufficientDiskError",
    "plan_shards",
    "publish_entry",
    "write_shard",
]

logger = logging.getLogger(__name__)

# Several shards per model let a hit hash them in parallel; 512 MiB keeps the file count modest
# (about 60 files for a 30 GB DiT).
DEFAULT_MAX_SHARD_BYTES = 512 << 20
# Left free after the entry is written, so publishing never fills the disk to the last block (logs,
# other caches and the checkpoint itself share it).
DISK_HEADROOM_BYTES = 64 << 20
_CHUNK_BYTES = 64 << 20

_ST_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
}


class InsufficientDiskError(CacheError):
    """The cache filesystem has less free space than the entry needs plus headroom."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_shards(
    tensors: Sequence[tuple[str, torch.Tensor]], *, max_shard_bytes: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """Split tensors, in the given order, into shards of at most ``max_shard_bytes`` (one tensor may exceed it)."""
    if max_shard_bytes < 1:
        raise CacheError(f"max_shard_bytes must be >= 1, got: {max_shard_bytes}")
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in tensors:
        n = _nbytes(t)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def _header(items: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    doc: dict[str, object] = {
        "__metadata__": {"format": "pt", "producer": "weight_sync.runtime_cache"}
    }
    offset = 0
    for name, t in items:
        n = _nbytes(t)
        doc[name] = {
            "dtype": _ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(doc, separators=(",", ":")).encode()
    # Padding the header to 8 bytes puts the data at an 8-aligned file offset; with tensors ordered by
    # descending element size every tensor is then aligned for a zero-copy typed view.
    return raw + b" " * (-len(raw) % 8)


def write_shard(
    path: Path, items: Sequence[tuple[str, torch.Tensor]]
) -> tuple[FileRecord, list[TensorRecord]]:
    """Write one safetensors file (created exclusively), hashing the file and each tensor on the way."""
    ordered = sorted(items, key=lambda it: -it[1].element_size())
    header = _header(ordered)
    file_hash = hashlib.sha256()
    records: list[TensorRecord] = []
    with open(path, "xb") as f:
        prefix = len(header).to_bytes(8, "little") + header
        f.write(prefix)
        file_hash.update(prefix)
        for name, t in ordered:
            data = t.detach().reshape(-1).view(torch.uint8).numpy()
            view = memoryview(data)  # type: ignore[arg-type]
            tensor_hash = hashlib.sha256()
            for start in range(0, len(view), _CHUNK_BYTES):
                chunk = view[start : start + _CHUNK_BYTES]
                _faults.reach("write_chunk")
                f.write(chunk)
                file_hash.update(chunk)
                tensor_hash.update(chunk)
            records.append(
                TensorRecord(
                    name,
                    path.name,
                    t.dtype,
                    tuple(int(d) for d in t.shape),
                    tensor_hash.hexdigest(),
                )
            )
        size = f.tell()
    return FileRecord(path.name, size, file_hash.hexdigest()), records


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_temp_dir(tmp: Path) -> None:
    try:
        shutil.rmtree(tmp)
    except OSError as e:
        # Called while another exception propagates; that one is the real failure. The leftover is
        # removed by the next writer of this key (it holds the lock, so the dir is provably stale).
        logger.error("could not remove runtime-cache temp dir %s: %s", tmp, e)


def publish_entry(
    root: CacheRoot,
    key: CacheKey,
    tensors: Sequence[tuple[str, torch.Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> EntryManifest:
    """Write and atomically publish ``tensors`` as entry ``key``. The caller must hold the key's lock.

    Tensors must be CPU, contiguous and of a supported dtype (checked by the caller). Raises
    :class:`InsufficientDiskError` before writing anything if space is short; on any failure before the
    rename the temp dir is removed and the exception propagates.
    """
    final = root.entry_dir(key.digest)
    if final.exists():
        raise CacheError(f"entry {final} already exists; publish_entry must not replace it")
    root.remove_stale_temp_dirs(key.digest)

    shards = plan_shards(tensors, max_shard_bytes=max_shard_bytes)
    needed = (
        sum(_nbytes(t) for _, t in tensors)
        + 4096 * (len(shards) + len(tensors))
        + DISK_HEADROOM_BYTES
    )
    # Looked up through the module so tests can substitute a fake statvfs-backed answer.
    free = root_mod.free_bytes(root.tmp)
    if free < needed:
        raise InsufficientDiskError(
            f"runtime cache at {root.path}: publishing needs {needed} bytes "
            f"(entry plus {DISK_HEADROOM_BYTES} headroom), found {free} free"
        )

    tmp = root.new_temp_dir(key.digest)
    renamed = False
    try:
        files: list[FileRecord] = []
        records: list[TensorRecord] = []
        for i, items in enumerate(shards):
            rec, trecs = write_shard(tmp / shard_name(i, len(shards)), items)
            files.append(rec)
            records.extend(trecs)
        _faults.reach("after_temp_write")
        manifest = EntryManifest(
            key=key.digest,
            key_material=key.material,
            created_unix_s=time.time(),
            files=tuple(files),
            tensors=tuple(sorted(records, key=lambda r: r.name)),
        )
        with open(tmp / MANIFEST_NAME, "x") as f:
            f.write(manifest.to_json())
        _faults.reach("before_fsync")
        for name in [f.name for f in files] + [MANIFEST_NAME]:
            # Read-only files: a stray writable mapping or open() elsewhere cannot alter a published
            # entry without first changing its mode.
            os.chmod(tmp / name, 0o400)
            _fsync_file(tmp / name)
        fsync_dir(tmp)
        _faults.reach("before_rename")
        # The single publication step: rename(2) of a directory within one filesystem is atomic, so a
        # reader resolving entries/<key> finds nothing or the complete, already-durable entry.
        os.rename(tmp, final)
        renamed = True
        _faults.reach("after_rename")
        fsync_dir(root.entries)
    except BaseException:
        if not renamed:
            _remove_temp_dir(tmp)
        raise
    logger.info(
        "published runtime-cache entry %s: %d tensors, %d files, %d bytes",
        final,
        len(records),
        len(files),
        manifest.total_bytes,
    )
    return manifest
