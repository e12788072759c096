"""``load_with_runtime_cache``: load a module's final weights through the node-local runtime cache.

Lifecycle of one call:

* **key** — computed before loading from the checkpoint file identity, the caller's transform identity,
  the :class:`LayoutIdentity` and the expected tensor schema;
* **hit** — a valid entry exists: take a shared lease, validate every file's SHA-256, map it and re-point
  the selected parameters/buffers onto the mapping. ``ordinary_load`` is never called;
* **miss** — call ``ordinary_load()``, then take the per-layout lock (with timeout) and either publish
  the loaded tensors (first process) or map what a peer published (after checking its bytes equal ours),
  re-point storage and drop the private copies;
* **fallback** — anything the cache cannot do safely (unsupported layout, lock timeout, short disk,
  failed validation) keeps the ordinary tensors, logs a warning with the reason and leaves nothing
  partial on disk. An entry that fails validation is removed if no live process maps it.

Re-pointing keeps every ``nn.Parameter``/buffer object; only the storage moves.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from weight_sync.errors import CacheError, ConfigError, WeightSyncError
from weight_sync.layers.storage import repoint
from weight_sync.offload.cache.entry import (
    CacheLease,
    map_entry,
    open_lease,
    read_manifest,
    validate_files,
)
from weight_sync.offload.cache.entry_manifest import EntryManifest
from weight_sync.offload.cache.identity import (
    CacheKey,
    CheckpointIdentityMode,
    LayoutIdentity,
    TensorSpec,
    checkpoint_identity,
    compute_cache_key,
)
from weight_sync.offload.cache.locking import LockTimeout, acquire_exclusive, release, try_lock
from weight_sync.offload.cache.publish import DEFAULT_MAX_SHARD_BYTES, publish_entry
from weight_sync.offload.cache.root import CacheRoot
from weight_sync.offload.cache.selection import (
    final_layout_problem,
    select_tensors,
    static_layout_problem,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_LOCK_TIMEOUT_S",
    "CacheStatus",
    "RuntimeCacheResult",
    "load_with_runtime_cache",
]

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/weight-sync/dlo-runtime-weights"
DEFAULT_LOCK_TIMEOUT_S = 600.0

CacheStatus = Literal["hit", "published", "mapped", "fallback"]


@dataclass(frozen=True, kw_only=True)
class RuntimeCacheResult:
    """What :func:`load_with_runtime_cache` did.

    ``status``: ``"hit"`` (mapped an entry without loading), ``"published"`` (loaded, wrote the entry,
    mapped it), ``"mapped"`` (loaded, then mapped a peer's entry), ``"fallback"`` (ordinary tensors kept;
    ``reason`` says why). ``lease`` holds the shared lock on the mapped entry until :meth:`close`.
    """

    status: CacheStatus
    reason: str
    key: str | None
    entry_dir: Path | None
    num_tensors: int
    nbytes: int
    elapsed_s: float
    ordinary_load_called: bool
    lease: CacheLease | None = None

    @property
    def uses_cache(self) -> bool:
        return self.status != "fallback"

    def close(self) -> None:
        """Release the entry's shared lock (eviction may then remove it; mapped pages stay valid)."""
        if self.lease is not None:
            self.lease.close()


class _Call:
    """Per-call state: keeps the timing and the "did we load" flag next to the steps that change them."""

    def __init__(self, module: nn.Module, ordinary_load: Callable[[], None]) -> None:
        self.module = module
        self._ordinary_load = ordinary_load
        self.loaded = False
        self.start = time.perf_counter()

    def load(self) -> None:
        self.loaded = True
        self._ordinary_load()

    def result(
        self,
        status: CacheStatus,
        reason: str,
        *,
        key: CacheKey | None = None,
        entry: Path | None = None,
        manifest: EntryManifest | None = None,
        lease: CacheLease | None = None,
    ) -> RuntimeCacheResult:
        if status == "fallback":
            logger.warning(
                "runtime cache not used, keeping the ordinarily loaded tensors: %s", reason
            )
        else:
            logger.info("runtime cache %s: %s", status, reason)
        return RuntimeCacheResult(
            status=status,
            reason=reason,
            key=key.digest if key else None,
            entry_dir=entry,
            num_tensors=len(manifest.tensors) if manifest else 0,
            nbytes=manifest.total_bytes if manifest else 0,
            elapsed_s=time.perf_counter() - self.start,
            ordinary_load_called=self.loaded,
            lease=lease,
        )


def _check_entry_matches(manifest: EntryManifest, specs: Sequence[TensorSpec]) -> None:
    have = {t.name: (t.shape, t.dtype) for t in manifest.tensors}
    want = {s.name: (s.shape, s.dtype) for s in specs}
    if have != want:
        diff = sorted(set(have.items()) ^ set(want.items()), key=lambda kv: kv[0])[:3]
        raise CacheError(
            f"entry {manifest.key[:12]}: tensors differ from the module's, e.g. {diff}"
        )


def _adopt(module: nn.Module, names: Sequence[str], mapped: Mapping[str, torch.Tensor]) -> None:
    # Shapes and dtypes were checked against the specs before this point, so no repoint can fail
    # halfway and leave a module that is part mapped, part unloaded.
    selected = select_tensors(module, names)
    for name in names:
        repoint(selected[name], mapped[name])


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise: torch.equal would call NaN != NaN a difference and -0.0 == 0.0 a match.
    return torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
    )


def _touch(entry: Path) -> None:
    # The entry directory's mtime is its last-use time for `weight-sync cache evict --older-than`.
    try:
        os.utime(entry)
    except OSError as e:
        logger.debug("could not record last use of %s: %s", entry, e)


def _open_valid(
    root: CacheRoot, key: CacheKey, specs: Sequence[TensorSpec]
) -> tuple[CacheLease, EntryManifest, dict[str, torch.Tensor]] | None:
    """Lease, validate and map entry ``key``; None if absent. Raises CacheError if it is invalid."""
    lease = open_lease(root, key.digest)
    if lease is None:
        return None
    try:
        manifest = read_manifest(lease, key.digest)
        _check_entry_matches(manifest, specs)
        validate_files(lease.entry, manifest)
        mapped = map_entry(lease.entry, manifest)
    except BaseException:
        lease.close()
        raise
    return lease, manifest, mapped


def _discard_invalid(root: CacheRoot, key: CacheKey) -> str:
    """Remove an invalid entry unless a live process maps it (caller holds the key's lock)."""
    entry = root.entry_dir(key.digest)
    lease = open_lease(root, key.digest)
    if lease is None:
        return "it is already gone"
    try:
        lease_fd = lease.fileno()
        # Upgrading our shared lock to exclusive succeeds only if no other process holds a lease.
        if not try_lock(lease_fd, shared=False):
            return "it stays because a live process maps it; run `weight-sync cache verify`"
        root.discard(entry)
    except OSError as e:
        return f"it could not be removed ({e}); run `weight-sync cache evict`"
    finally:
        lease.close()
    return "it was removed so the next start republishes"


def load_with_runtime_cache(
    module: nn.Module,
    *,
    checkpoint_files: Sequence[str | os.PathLike],
    transform_id: str,
    layout: LayoutIdentity,
    ordinary_load: Callable[[], None],
    tensor_names: Sequence[str] | None = None,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
    checkpoint_identity_mode: CheckpointIdentityMode = "stat",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> RuntimeCacheResult:
    """Give ``module``'s parameters and persistent buffers cache-backed storage, loading only on a miss.

    Args:
        module: the constructed module; its selected tensors keep their Python objects.
        checkpoint_files: the files ``ordinary_load`` reads (their identity is part of the key).
        transform_id: identifies the loader and every transformation between checkpoint and final
            weights (fusion, sharding, padding); change it whenever that code changes.
        layout: the runtime layout identity (TP coordinate, SP guard, dtype/layout, model version).
        ordinary_load: loads the final weights into ``module`` in place; called at most once, and
            never on a hit.
        tensor_names: qualified names to cache (default: all parameters and persistent buffers).
        cache_dir: the node-local cache root (created 0700).
        lock_timeout_s: how long to wait for another process publishing the same layout.
        checkpoint_identity_mode: ``"stat"`` (path/size/inode/mtime/ctime) or ``"sha256"`` (contents).
        max_shard_bytes: upper bound of one shard file when publishing.

    Exceptions raised by ``ordinary_load`` propagate unchanged; cache problems never raise, they fall back.
    """
    if not isinstance(layout, LayoutIdentity):
        raise ConfigError(f"layout must be a LayoutIdentity, got: {type(layout).__name__}")
    if not callable(ordinary_load):
        raise ConfigError(f"ordinary_load must be callable, got: {ordinary_load!r}")
    if (
        not isinstance(lock_timeout_s, (int, float))
        or not math.isfinite(lock_timeout_s)
        or lock_timeout_s < 0
    ):
        raise ConfigError(f"lock_timeout_s must be a finite number >= 0, got: {lock_timeout_s!r}")
    call = _Call(module, ordinary_load)
    selected = select_tensors(module, tensor_names)
    names = list(selected)
    specs = [TensorSpec.of(n, t) for n, t in selected.items()]
    key = compute_cache_key(
        checkpoint=checkpoint_identity(checkpoint_files, mode=checkpoint_identity_mode),
        transform_id=transform_id,
        layout=layout,
        tensors=specs,
    )
    tag = f"{layout.describe()} key {key.digest[:12]}"

    problem = static_layout_problem(selected)
    if problem:
        call.load()
        return call.result("fallback", f"{tag}: unsupported layout: {problem}", key=key)
    root = CacheRoot.at(cache_dir)
    try:
        root.ensure()
    except (CacheError, OSError) as e:
        call.load()
        return call.result("fallback", f"{tag}: cache root unusable: {e}", key=key)

    # A hit re-points existing CPU tensors; meta tensors cannot take CPU storage, so they load first.
    if all(t.device.type == "cpu" for t in selected.values()):
        try:
            found = _open_valid(root, key, specs)
        except (CacheError, OSError) as e:
            # Decided under the lock below: the entry may be replaced by then, and removing an
            # invalid one is only safe while holding the publisher lock.
            logger.warning("runtime-cache entry failed validation: %s", e)
            found = None
        if found is not None:
            lease, manifest, mapped = found
            _adopt(module, names, mapped)
            _touch(lease.entry)
            return call.result(
                "hit",
                f"{tag}: mapped {lease.entry} without loading",
                key=key,
                entry=lease.entry,
                manifest=manifest,
                lease=lease,
            )

    call.load()
    loaded = select_tensors(module, names)
    problem = final_layout_problem(loaded, specs)
    if problem:
        return call.result("fallback", f"{tag}: unsupported layout: {problem}", key=key)
    try:
        lock_fd = acquire_exclusive(
            root.lock_path(key.digest), timeout_s=lock_timeout_s, what=f"runtime-cache entry {tag}"
        )
    except LockTimeout as e:
        return call.result("fallback", f"lock timeout: {e}", key=key)
    except OSError as e:
        return call.result("fallback", f"{tag}: cannot open the publisher lock: {e}", key=key)
    try:
        return _publish_or_map(call, root, key, tag, names, specs, loaded, max_shard_bytes)
    except (CacheError, OSError) as e:
        # _publish_or_map handles the expected failures itself; this net keeps the promise that cache
        # trouble never fails a load (the ordinary tensors are still in place: nothing was re-pointed).
        return call.result("fallback", f"{tag}: {e}", key=key)
    finally:
        release(lock_fd)


def _publish_or_map(
    call: _Call,
    root: CacheRoot,
    key: CacheKey,
    tag: str,
    names: Sequence[str],
    specs: Sequence[TensorSpec],
    loaded: Mapping[str, torch.Tensor],
    max_shard_bytes: int,
) -> RuntimeCacheResult:
    """The locked part of a miss: map a peer's entry or publish ours. Caller holds the key's lock."""
    try:
        found = _open_valid(root, key, specs)
    except (CacheError, OSError) as e:
        fate = _discard_invalid(root, key)
        return call.result("fallback", f"{tag}: entry failed validation ({e}); {fate}", key=key)
    status: CacheStatus
    if found is not None:
        lease, manifest, mapped = found
        differing = [n for n in names if not _same_bytes(loaded[n], mapped[n])]
        if differing:
            lease.close()
            return call.result(
                "fallback",
                f"{tag}: the published entry differs from this process's loaded weights in "
                f"{differing[:3]} (non-deterministic loader or transform_id not specific enough)",
                key=key,
            )
        status, how = "mapped", "mapped the entry another process published"
    else:
        try:
            manifest = publish_entry(
                root, key, [(n, loaded[n]) for n in names], max_shard_bytes=max_shard_bytes
            )
        except (WeightSyncError, OSError) as e:
            return call.result("fallback", f"{tag}: could not publish: {e}", key=key)
        lease_or_none = open_lease(root, key.digest)
        if lease_or_none is None:
            return call.result(
                "fallback", f"{tag}: published entry vanished before it was mapped", key=key
            )
        lease = lease_or_none
        try:
            mapped = map_entry(lease.entry, manifest)
        except (CacheError, OSError) as e:
            lease.close()
            return call.result(
                "fallback", f"{tag}: cannot map the entry just published: {e}", key=key
            )
        status, how = "published", "published and mapped a new entry"
    _adopt(call.module, names, mapped)
    _touch(lease.entry)
    return call.result(
        status,
        f"{tag}: {how} at {lease.entry}",
        key=key,
        entry=lease.entry,
        manifest=manifest,
        lease=lease,
    )
