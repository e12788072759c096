"""Offload counters and the optional per-block timeline (compute / H2D / AllGather spans).

Counters are plain ints, each written by one thread only (the compute thread or the submission thread),
so reading them needs no lock. The trace records spans as CUDA timing events on GPU (drawn from a pool
allocated when tracing is enabled, so recording allocates nothing) and as ``perf_counter`` stamps on
CPU, where the copies really run on the submission thread while the compute thread computes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from weight_sync.layers import DeviceShim, Event

__all__ = [
    "OffloadMetrics",
    "Span",
    "Trace",
]


@dataclass
class OffloadMetrics:
    """What offload did so far; ``as_dict`` is what ``handle.metrics()`` returns."""

    h2d_bytes: int = 0  # host -> slot bytes (on CPU: host -> slot copies)
    fabric_bytes: int = 0  # bytes received from peers by AllGather
    pinned_bytes: int = 0  # page-locked host bytes (arena, staging or pinned in place)
    num_fallbacks: int = 0  # storage decisions that fell back (mmap -> loader, pin -> pageable, ...)
    host_bytes: int = 0  # host bytes held for streamed block weights by this rank
    mapped_bytes: int = 0  # the part of host_bytes that is a shared file mapping
    block_bytes: int = 0  # unsharded bytes of all streamed blocks
    slot_bytes: int = 0  # bytes of each of the two device slots
    num_slots_allocated: int = 0
    # dlo_landing_buffers with AllGather: bytes of each of the two device landing buffers (one shard of
    # the largest block) and how many were allocated (2, else 0). Device memory for streamed blocks is
    # num_slots_allocated * slot_bytes + num_landing_buffers_allocated * landing_bytes.
    landing_bytes: int = 0
    num_landing_buffers_allocated: int = 0
    num_streamed_blocks: int = 0
    num_resident_blocks: int = 0
    num_block_loads: int = 0  # loads consumed by a block forward
    num_gathers: int = 0
    num_prefetch_misses: int = 0  # a block ran that was not the one prefetched (first step, new ring)
    num_call_agreements: int = 0  # calls the gather group agreed on before their first gather (AllGather)
    gather_group_size: int = 1
    host_storage: str = ""  # "packed", "pinned_in_place", "staged"
    host_weights_source: str = ""  # "ordinary", "checkpoint_mmap", "runtime_cache"
    quantization: str = ""  # the quant-registry name the block linears were quantized with ("" = none)
    num_quantized_linears: int = 0
    num_updates: int = 0  # weight updates committed into the offloaded model (weight_sync.offload.update)
    num_storage_moves: int = 0  # read-only mapped host weights moved to a private arena by an update
    update_scratch_peak_bytes: int = 0  # AllGather: most full-block scratch held at once by an update
    fallback_reasons: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fallback_reasons"] = list(self.fallback_reasons)
        return d


@dataclass(frozen=True)
class Span:
    """One interval of the timeline, in milliseconds since tracing started."""

    kind: str  # "compute", "h2d" or "allgather"
    block: str
    start_ms: float
    end_ms: float


class Trace:
    """Collects spans from both threads; bounded by ``capacity`` (older spans are kept, newer dropped)."""

    def __init__(self, shim: DeviceShim, capacity: int) -> None:
        self.shim = shim
        self.capacity = capacity
        self._lock = threading.Lock()
        self._raw: list[tuple[str, str, Any, Any]] = []
        self.dropped = 0
        if shim.is_cuda:
            self._pool: list[Event] = [shim.event(timing=True) for _ in range(2 * capacity)]
            self._base = shim.event(timing=True)
            self._base.record()
        else:
            self._pool = []
            self._t0 = time.perf_counter()
        self._used = 0

    def reset(self) -> None:
        """Drop recorded spans and restart the clock (e.g. after warm-up); reuses the event pool."""
        self.shim.synchronize()
        with self._lock:
            self._raw.clear()
            self._used = 0
            self.dropped = 0
            if self.shim.is_cuda:
                self._base.record()
            else:
                self._t0 = time.perf_counter()

    def begin(self) -> Any:
        """A start mark on the current stream (GPU) or now (CPU); None once the pool is spent."""
        if not self.shim.is_cuda:
            return time.perf_counter()
        with self._lock:
            if self._used >= len(self._pool):
                self.dropped += 1
                return None
            ev = self._pool[self._used]
            self._used += 1
        ev.record()
        return ev

    def end(self, kind: str, block: str, start: Any) -> None:
        if start is None:
            return
        stop = self.begin()
        if stop is None:
            return
        with self._lock:
            if len(self._raw) < self.capacity:
                self._raw.append((kind, block, start, stop))
            else:
                self.dropped += 1

    def spans(self) -> list[Span]:
        """Resolved spans (synchronizes the device once: call it after the timed work)."""
        self.shim.synchronize()
        out = []
        with self._lock:
            raw = list(self._raw)
        for kind, block, a, b in raw:
            if self.shim.is_cuda:
                out.append(Span(kind, block, self._base.elapsed_ms(a), self._base.elapsed_ms(b)))
            else:
                out.append(Span(kind, block, (a - self._t0) * 1e3, (b - self._t0) * 1e3))
        return sorted(out, key=lambda s: s.start_ms)
