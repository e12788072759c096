"""Stage an update while the live model serves; stop serving only for the commit that copies it in.

A :class:`StagedWeights` keeps a *staging twin* of a live model: a second instance of the same model
class with the same layout, on the live model's device when memory allows and in pinned host memory
otherwise. Updates run on the twin through the ordinary lifecycle (``begin_update`` / ``load`` /
``finish``: manifest first, checksums, processing such as online quantization, the pointer audit), so
the live model keeps serving the committed version the whole time. ``commit()`` then copies every
graph-visible tensor of the twin into the live tensor of the same name, in place: addresses, shapes
and strides of the live tensors never change, so captured CUDA graphs stay valid, and the caller runs
it between two steps of its own, so every token is computed with exactly one version.

Guarantees:

- A failure before the commit (a bad manifest, a checksum, a dead trainer, processing) aborts the
  twin's session; the live model is never written, and nothing is pending.
- A staged update that has not been committed when the next one begins is superseded by it (the twin
  holds the newer version; a failed newer update that was rolled back makes the older one pending again).
- A partial staged update (a delta) applies to the served version: it is refused when the twin does
  not hold it (no full staged update yet on a quantized model, or a direct update of the live model
  since the last commit).
- The twin's kernel layout must equal the live model's (names, shapes, dtypes, checked as a
  post-update hook of the twin, so a mismatch fails the staged update rather than the commit).

Limitations: the twin is one extra copy of the kernel tensors (``num_bytes``); a quantized live model
cannot seed its twin (the twin holds model-format tensors until its first update), so its first staged
update must be a full one; a host twin of a CUDA model processes (quantizes) on the CPU, whose results
may differ bitwise from the GPU's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from weight_sync.errors import ConfigError, LayoutMismatchError, UpdateStateError
from weight_sync.layers.tensors import iter_graph_visible_tensors
from weight_sync.reload.api import begin_update, record_metadata_for_reloading
from weight_sync.reload.session import UpdateSession
from weight_sync.reload.state import check_servable, get_state, register_post_update_hook

__all__ = ["STAGING_PLACEMENTS", "CommitReport", "StagedWeights", "StagingConfig", "staged_bytes"]

log = logging.getLogger(__name__)

#: Where the twin lives: 'auto' (the live device when it fits the device budget, else pinned host),
#: 'device' (refuse when it does not fit), 'host' (always host memory).
STAGING_PLACEMENTS = ("auto", "device", "host")

# Host storages at least this large are page-locked in place; glibc serves them from their own mmap
# (its threshold is 128 KiB, grown dynamically up to 32 MiB), so they share no page with another.
_REGISTER_MIN_BYTES = 32 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class StagingConfig:
    """Where the staging twin lives and how much memory it may take.

    device_budget_bytes: the most device memory the twin may use (None: 90% of the device's free
    memory when the twin is built). max_bytes: a bound on the twin wherever it lives (None: no bound);
    a twin larger than it is refused at construction. pin_host: page-lock a host twin's tensors so the
    commit is an asynchronous H2D copy (CUDA live models only).
    """

    placement: str = "auto"
    device_budget_bytes: int | None = None
    max_bytes: int | None = None
    pin_host: bool = True

    def __post_init__(self) -> None:
        if self.placement not in STAGING_PLACEMENTS:
            raise ConfigError(f"placement must be one of {STAGING_PLACEMENTS}, got {self.placement!r}")
        for name in ("device_budget_bytes", "max_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ConfigError(f"{name} must be None or an int >= 0, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class CommitReport:
    """One commit: the version made live, what was copied, and how long serving stopped for it."""

    version: Any
    superseded: tuple[Any, ...]
    num_tensors: int
    num_bytes: int
    seconds: float
    placement: str


def _staged_tensors(model: nn.Module, skip: frozenset[str]) -> list[tuple[str, torch.Tensor]]:
    """The graph-visible tensors a twin stages: all but those whose attribute name is in ``skip``."""
    return [(n, t) for n, t in iter_graph_visible_tensors(model) if n.rsplit(".", 1)[-1] not in skip]


def _layout(model: nn.Module, skip: frozenset[str] = frozenset()) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    return {n: (tuple(t.shape), t.dtype) for n, t in _staged_tensors(model, skip) if t.device.type != "meta"}


def staged_bytes(model: nn.Module, skip: frozenset[str] = frozenset()) -> int:
    """Bytes of the tensors a staging twin of ``model`` holds: every graph-visible tensor (parameters,
    buffers and tensor attributes, each once) outside ``skip``."""
    return sum(t.numel() * t.element_size() for _, t in _staged_tensors(model, skip))


class StagedWeights:
    """A staging twin of ``live`` that takes updates while ``live`` serves; see the module docstring.

    ``build_twin(device)`` returns a new model of ``live``'s class and configuration on ``device``
    (its reload metadata is recorded here). Pass this object to a :class:`WeightReceiver` (it has
    ``begin_update`` and ``model``, the twin) or call :meth:`begin_update` directly; call
    :meth:`commit` at a point where the live model is not computing (a step boundary).

    ``carry_state(src, dst)``: for kernel state a processor keeps outside tensors (vLLM-CPU's oneDNN
    handles of prepacked linear weights), which no tensor copy moves; called after the tensor copies
    when the twin is seeded (live -> twin) and in every commit (twin -> live). It must install
    ``src``'s objects in ``dst`` rather than write into them: after a commit both models share them,
    and the twin's next update replaces its own. ``skip_attrs``: names of graph-visible tensor
    attributes that are not weights and are never staged or copied (vLLM's attention ``kv_cache``).
    """

    def __init__(
        self,
        live: nn.Module,
        build_twin: Callable[[torch.device], nn.Module],
        *,
        config: StagingConfig | None = None,
        carry_state: Callable[[nn.Module, nn.Module], None] | None = None,
        skip_attrs: frozenset[str] = frozenset(),
    ) -> None:
        self.config = config or StagingConfig()
        self.live = live
        self._carry_state = carry_state
        self._skip = frozenset(skip_attrs)
        live_tensors = list(iter_graph_visible_tensors(live))
        if not live_tensors:
            raise ConfigError(f"{type(live).__name__} has no graph-visible tensors to stage")
        self.live_device = live_tensors[0][1].device
        live_state = get_state(live, create=True)
        # The twin holds the larger of the kernel form and the model format (a quantized twin is in
        # model format until its first update is processed).
        estimate = max(staged_bytes(live, self._skip), sum(i.model_format_bytes for i in live_state.layers.values()))
        self.device, self.placement = self._place(estimate)
        self.model = build_twin(self.device)
        record_metadata_for_reloading(self.model)
        self.num_bytes = staged_bytes(self.model, self._skip)
        if self.config.max_bytes is not None and self.num_bytes > self.config.max_bytes:
            raise ConfigError(
                f"the staging twin takes {self.num_bytes} bytes on {self.device}, over "
                f"StagingConfig.max_bytes={self.config.max_bytes}"
            )
        self._lock = threading.Lock()
        self._pending: UpdateSession | None = None  # the twin's last finished session, not committed
        # The report of the last staged update that finished (set by a WeightReceiver too).
        self.last_report: Any = None
        self._superseded: list[Any] = []
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pinned: list[int] = []  # host storages registered with cudaHostRegister
        self._host_pinned = False
        self._copied: torch.cuda.Event | None = None
        self.committed_version: Any = live_state.version
        self.last_commit: CommitReport | None = None
        self.num_commits = 0
        self.seeded = _layout(self.model, self._skip) == _layout(live, self._skip)
        if self.seeded:
            self._seed(live_state)
        register_post_update_hook(self.model, self._check_layout)

    # ------------------------------------------------------------------ construction
    def _place(self, estimate: int) -> tuple[torch.device, str]:
        if self.live_device.type != "cuda" or self.config.placement == "host":
            where = "device" if self.live_device.type == "cpu" else "host"
            return torch.device("cpu"), where
        budget = self.config.device_budget_bytes
        if budget is None:
            budget = int(torch.cuda.mem_get_info(self.live_device)[0] * 0.9)
        if estimate <= budget:
            return self.live_device, "device"
        if self.config.placement == "device":
            raise ConfigError(
                f"the staging twin needs about {estimate} bytes on {self.live_device}, over the device "
                f"budget of {budget} bytes (StagingConfig.device_budget_bytes); use placement 'auto' or 'host'"
            )
        log.info("staging twin (%d bytes) over the device budget (%d): staging in host memory", estimate, budget)
        return torch.device("cpu"), "host"

    def _seed(self, live_state: Any) -> None:
        """Start the twin at the live version, so a partial update (a delta) applies to the right base."""
        live_named = dict(_staged_tensors(self.live, self._skip))
        with torch.no_grad():
            for name, t in _staged_tensors(self.model, self._skip):
                t.copy_(live_named[name])
        if self._carry_state is not None:
            self._carry_state(self.live, self.model)
        twin_state = get_state(self.model)
        twin_state.reference = live_state.reference
        twin_state.version = live_state.version
        self._refresh_pairs()

    def _check_layout(self, twin: nn.Module) -> None:
        """Post-update hook of the twin: its kernel layout must be the live model's, name for name."""
        got, want = _layout(twin, self._skip), _layout(self.live, self._skip)
        if got == want:
            return
        names = sorted(set(got) ^ set(want)) or sorted(n for n in want if got[n] != want[n])
        detail = [f"{n}: live {want.get(n)}, staged {got.get(n)}" for n in names[:4]]
        raise LayoutMismatchError(
            f"the staged update's kernel tensors differ from the live model's in {len(names)} place(s) "
            f"(a commit could not copy them in place): {'; '.join(detail)}"
        )

    def _refresh_pairs(self) -> None:
        live_named = dict(_staged_tensors(self.live, self._skip))
        self._pairs = [(live_named[n], t) for n, t in _staged_tensors(self.model, self._skip)]
        self.num_bytes = sum(t.numel() * t.element_size() for _, t in self._pairs)
        if self.placement == "host" and self.live_device.type == "cuda" and self.config.pin_host:
            self._pin()

    def _pin(self) -> None:
        """Page-lock the twin's host tensors, so a commit is an asynchronous H2D copy.

        Large storages (glibc maps them page-aligned, one per mapping) are registered in place, so they
        keep their addresses. Small ones may share a page with other allocations, which cannot be
        registered twice: they move into pinned memory instead (``t.data = pinned``: the same tensor
        object, so the session's layer records and the pairs still hold it; the twin's cached views are
        refreshed at its next update, which sees the new address).
        """
        cudart = torch.cuda.cudart()
        registered = set(self._pinned)
        with torch.no_grad():
            for _, src in self._pairs:
                storage = src.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if ptr in registered or src.is_pinned():
                    continue
                if nbytes < _REGISTER_MIN_BYTES:
                    src.data = src.data.pin_memory()
                    continue
                err = cudart.cudaHostRegister(ptr, nbytes, 0)
                if int(err) != 0:
                    raise UpdateStateError(
                        f"cudaHostRegister of a staged host tensor {tuple(src.shape)} ({nbytes} bytes at "
                        f"{ptr:#x}) failed with {err}; use StagingConfig(pin_host=False)"
                    )
                self._pinned.append(ptr)
                registered.add(ptr)
        self._host_pinned = True

    # ------------------------------------------------------------------ staging
    @property
    def pending_version(self) -> Any:
        """The version staged and waiting for a commit (None when nothing is pending)."""
        pending = self._pending
        return None if pending is None else pending.version

    def has_pending(self) -> bool:
        return self._pending is not None

    def begin_update(self, manifest: Any = None, **options: Any) -> UpdateSession:
        """Open an update on the twin (the options of :func:`weight_sync.begin_update`); the live model
        keeps serving. A staged version not yet committed is superseded by this one."""
        if get_state(self.live).version != self.committed_version:
            # The live model was updated directly since the last commit: the twin no longer holds the
            # served version, so a partial update on it would apply to the wrong base.
            self.seeded = False
        if options.get("allow_partial") and not self.seeded:
            raise UpdateStateError(
                "the staging twin does not hold the served version (a quantized live model cannot seed it, "
                "or the live model was updated directly since the last commit): the next staged update "
                "must be a full one, got allow_partial=True"
            )
        with self._lock:
            copied, self._copied = self._copied, None
            if copied is not None:
                # The last commit's copies out of the twin may still be queued on the live device; the
                # twin must not be written before they ran.
                copied.synchronize()
            superseded, self._pending = self._pending, None
            try:
                session = begin_update(self.model, manifest, **options)
            except BaseException:
                self._pending = superseded
                raise
        session.on_close(lambda: self._closed(session, superseded))
        return session

    def _closed(self, session: UpdateSession, superseded: Any) -> None:
        """The twin's session ended: a finished one becomes pending; a failed one leaves nothing new.

        Runs inside the session's close, before its report exists: the session itself is kept."""
        with self._lock:
            if session.status != "finished":
                # Rolled back (or nothing written): the twin holds the superseded version again, which
                # may still be committed; torn: nothing on the twin may be committed.
                self._pending = superseded if not get_state(self.model).torn_layers else None
                return
            if superseded is not None:
                self._superseded.append(superseded.version)
            self.seeded = True
            self._refresh_pairs()
            if self.device.type == "cuda":
                # The twin's writes (on whatever streams the transport used) complete before any commit.
                torch.cuda.synchronize(self.device)
            self._pending = session

    # ------------------------------------------------------------------ commit
    def commit(self) -> CommitReport | None:
        """Copy the pending staged version into the live tensors in place; None when nothing is pending.

        Call it where the live model is not computing. On CUDA the copies are queued on the current
        stream (before the next step's kernels); ``seconds`` includes waiting for them.
        """
        with self._lock:
            pending = self._pending
            if pending is None:
                return None
            live_state = get_state(self.live)
            if live_state.active is not None:
                raise UpdateStateError(
                    f"commit of staged version {pending.version!r}: update {live_state.active.version!r} is "
                    "open on the live model itself; finish or abort it first"
                )
            check_servable(self.model)
            t0 = time.perf_counter()
            self._copy()
            if self._carry_state is not None:
                self._carry_state(self.model, self.live)
            seconds = time.perf_counter() - t0
            live_state.version = pending.version
            self.last_report = pending.report
            superseded, self._superseded = tuple(self._superseded), []
            self._pending = None
            self.committed_version = pending.version
            self.num_commits += 1
            self.last_commit = CommitReport(
                version=pending.version, superseded=superseded, num_tensors=len(self._pairs),
                num_bytes=self.num_bytes, seconds=seconds, placement=self.placement,
            )
            return self.last_commit

    def _copy(self) -> None:
        with torch.no_grad():
            same = [(d, s) for d, s in self._pairs if d.device == s.device]
            cross = [(d, s) for d, s in self._pairs if d.device != s.device]
            if same:
                torch._foreach_copy_([d for d, _ in same], [s for _, s in same])
            for d, s in cross:
                d.copy_(s, non_blocking=self._host_pinned)
            if self.live_device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(self.live_device))
                self._copied = event
                # The pause is the copy itself: the caller's next step would wait for it anyway.
                event.synchronize()

    def close(self) -> None:
        """Release the page-locked host memory of a host twin (the twin stays usable, unpinned)."""
        with self._lock:
            if self._pinned:
                cudart = torch.cuda.cudart()
                for ptr in self._pinned:
                    cudart.cudaHostUnregister(ptr)
                self._pinned = []
