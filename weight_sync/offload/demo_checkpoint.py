"""The demo's checkpoint: one deterministic path per model configuration, written once, atomically.

``weight-sync offload-demo`` needs a checkpoint whenever host weights are loaded from files (the
runtime cache, ``--checkpoint``). The runtime cache keys entries on the checkpoint's *file identity*
(path, size, inode, mtime, ctime), so a private checkpoint per run would give every run its own entry:
three demos started at once would publish three copies of one model, which is not what replicas of one
model path do. By default the demo therefore uses ``<tmp>/weight-sync-offload-demo-<uid>/<digest>/``,
where the digest covers everything that determines the bytes (model shape, dtype, seed, torch version,
this format's version): concurrent runs of one configuration share one file, hence one cache entry.

Writing is safe under concurrency and crashes: the first process takes an exclusive ``flock`` on
``.model.safetensors.lock`` beside the file (bounded wait), writes ``.model.safetensors.<pid>.tmp``,
fsyncs it and renames it to ``model.safetensors`` (atomic within a directory). Readers see no file or a
complete one; a writer killed mid-way leaves a temp file that the next writer removes under the lock.
The file is never rewritten once present, so its identity (and the cache key) stays stable.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from weight_sync.errors import ConfigError

__all__ = ["CHECKPOINT_FILE", "config_digest", "default_checkpoint_dir", "ensure_checkpoint"]

CHECKPOINT_FILE = "model.safetensors"
_FORMAT = 1  # bump when the demo model's construction or file layout changes the bytes


def config_digest(model: dict[str, Any]) -> str:
    """A short SHA-256 of what determines the demo checkpoint's bytes."""
    doc = {"format": _FORMAT, "torch": torch.__version__, **model}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:20]


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or check that it is a directory of ours that nobody else can write."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"demo checkpoint directory {path}: expected a directory owned by uid {os.getuid()} and not "
            f"writable by group or others, found mode {stat.filemode(st.st_mode)} owned by uid {st.st_uid}"
        )


def default_checkpoint_dir(model: dict[str, Any]) -> Path:
    """``<tmp>/weight-sync-offload-demo-<uid>/<digest of model>``, created private (0700)."""
    root = Path(tempfile.gettempdir()) / f"weight-sync-offload-demo-{os.getuid()}"
    _private_dir(root)
    path = root / config_digest(model)
    _private_dir(path)
    return path


def ensure_checkpoint(
    path: Path, write: Callable[[Path], None], *, lock_timeout_s: float = 600.0
) -> Path:
    """``path/model.safetensors``, written by ``write(tmp_file)`` under the lock if it does not exist yet."""
    from weight_sync.offload.cache.locking import acquire_exclusive, release

    path.mkdir(parents=True, exist_ok=True)
    final = path / CHECKPOINT_FILE
    if final.exists():  # complete by construction: it only ever appears by rename
        return final
    fd = acquire_exclusive(path / f".{CHECKPOINT_FILE}.lock", timeout_s=lock_timeout_s,
                           what=f"demo checkpoint {final}")
    try:
        if final.exists():  # another process wrote it while this one waited
            return final
        # A live writer would hold the lock we now hold: temp files left here are a dead writer's.
        for stale in path.glob(f".{CHECKPOINT_FILE}.*.tmp"):
            stale.unlink(missing_ok=True)
        tmp = path / f".{CHECKPOINT_FILE}.{os.getpid()}.tmp"
        try:
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.rename(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename survives a power loss
        finally:
            os.close(dir_fd)
    finally:
        release(fd)
    return final
