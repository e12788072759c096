"""DLO runtime-weight cache: crash-safe, node-local sharing of a module's final weights through mmap.

Processes whose final weights are identical (same checkpoint files, loader/transform, TP coordinate,
SP guard, dtype/layout and model version; DP rank and SP rank excluded) share one entry of sharded
safetensors files: one process publishes, the others map the same files, so the OS page cache holds a
single copy. The key is computed before loading, so a later start with a valid entry maps it and never
runs the ordinary loader. ``weight-sync cache ls | verify | evict`` manages entries; an entry a live
process maps (a shared ``flock`` lease) is never removed.

Limitations:

* node-local only: the root must be on a local, disk-backed filesystem (a warning is logged for
  tmpfs/ramfs and network filesystems; flock and rename are not trusted across nodes);
* quantized (int8/uint8/fp8) or subclassed tensors, non-contiguous, tied/aliased, meta-after-load and
  device tensors are not cached; such modules keep their ordinary tensors (status ``"fallback"``);
* a tensor whose shape or dtype changes during loading is not cached (the key uses the pre-load schema);
* a miss still loads privately first, so concurrent cold starts each pay one load; only hits skip it;
* ``transform_id`` is trusted: the caller must change it whenever loading code changes the final bytes
  (a peer's entry that differs from freshly loaded bytes is detected and refused on the miss path only);
* the ``"stat"`` checkpoint identity misses after a harmless ``chmod``/``touch`` of the checkpoint;
* lock files under ``locks/`` are never deleted (a few bytes per key ever published);
* cached tensors are pageable private mappings: writing to one copies that page into the process.
"""

from weight_sync.offload.cache.entry import CacheLease
from weight_sync.offload.cache.eviction import (
    EntryInfo,
    EvictionReport,
    evict_entries,
    list_entries,
    verify_entry,
)
from weight_sync.offload.cache.identity import LayoutIdentity, compute_cache_key
from weight_sync.offload.cache.root import CacheRoot
from weight_sync.offload.cache.runtime import (
    DEFAULT_CACHE_DIR,
    DEFAULT_LOCK_TIMEOUT_S,
    CacheStatus,
    RuntimeCacheResult,
    load_with_runtime_cache,
)

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_LOCK_TIMEOUT_S",
    "CacheLease",
    "CacheRoot",
    "CacheStatus",
    "EntryInfo",
    "EvictionReport",
    "LayoutIdentity",
    "RuntimeCacheResult",
    "compute_cache_key",
    "evict_entries",
    "list_entries",
    "load_with_runtime_cache",
    "verify_entry",
]
