"""The end of an update: completeness, prepare and commit (or abort), the report, the close.

:class:`EndingSteps` holds these steps for :class:`~weight_sync.reload.session.UpdateSession`, which owns
the state they read and write (declared in :class:`~weight_sync.reload.processing.ProcessedLayers`).
``finish()`` is ``prepare()`` - every check that can fail, which aborts the session on failure -
followed by ``commit()``, bookkeeping that cannot fail, so a transport can prepare every rank, agree in
one exchange and only then commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from weight_sync.errors import IncompleteUpdateError, PointerChangedError, UpdateStateError
from weight_sync.layers.tensors import signatures
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.quant.online import RowBands
from weight_sync.reload.audit import Baseline, verify_baseline
from weight_sync.reload.report import UpdateReport, fingerprint
from weight_sync.reload.units import UnitLayers
from weight_sync.reload.validation import lacking_from_reference, name_list, rewritten_layers

__all__ = ["EndingSteps"]

# The session's logger: its warnings (out-of-order buffering) keep the name users filter on.
log = logging.getLogger("weight_sync.reload.session")


class EndingSteps(UnitLayers):
    """The ending steps of an update session (its state is declared in ProcessedLayers, set there)."""

    _status: str
    _arrived: set[str]
    _announced: dict[str, tuple[torch.Size, torch.dtype]] | None
    _unannounced_applied: int
    _prepared: tuple[list[str], str | None] | None
    report: UpdateReport | None
    allow_partial: bool
    compute_fingerprint: bool
    manifest: Manifest | None
    _baseline: Baseline
    _before: dict[str, Any]
    _keep_baseline: bool
    _banded: dict[str, dict[str, RowBands]]
    _on_close: list[Callable[[], None]]
    _num_bytes: int
    _replayed: int
    _via_loader: int
    _ignored: list[str]
    _t0: float

    def _require_open(self) -> None:
        if self._status != "open":
            raise UpdateStateError(f"update {self.version!r} is already {self._status}")

    def missing(self) -> list[str]:
        """Expected keys that have not arrived yet (ignored keys excluded)."""
        if self.expected is None or self._all_expected_arrived():
            return []
        out = []
        for n in self.expected - self._arrived:
            kp = self.plan.keys.get(n)
            if kp is None or kp.mode != "ignored":
                out.append(n)
        return sorted(out)

    def finish(self) -> UpdateReport:
        """Commit: check completeness, process what is pending, verify pointers, run hooks, report."""
        self.prepare()
        return self.commit()

    def prepare(self) -> None:
        """The part of :meth:`finish` that can fail: completeness, pending processing, hooks, pointer audit
        (and the fingerprint). On failure the session is aborted; after success only :meth:`commit`
        (bookkeeping that cannot fail) or :meth:`abort` remain, so ranks can agree before any commits."""
        self._require_open()
        if self._prepared is not None:
            return
        try:
            missing = self.missing()
            if missing and not self.allow_partial:
                raise IncompleteUpdateError(
                    f"update {self.version!r} finished with {len(missing)} expected tensor(s) missing: "
                    f"{name_list(missing)}",
                    tuple(missing),
                )
            for ol in list(self._open.values()):
                if self.expected is None:
                    with torch.no_grad():
                        self._complete(ol)  # no key list known: every layer waited for the end
                elif ol.remaining:
                    raise IncompleteUpdateError(
                        f"layer {ol.info.name} needs processing and so needs all of its tensors; "
                        f"missing {name_list(ol.remaining)}",
                        tuple(sorted(ol.remaining)),
                    )
            self._check_units_complete()
            for layer in () if self._all_expected_arrived() else self._banded:
                # (All expected arrived: a banded layer is processed, so the validated manifest
                # announced every one of its keys.)
                lacking = self.plan.layer_keys.get(layer, set()) - self._arrived
                if lacking:
                    raise IncompleteUpdateError(
                        f"layer {layer} needs processing and so needs all of its tensors; "
                        f"missing {name_list(lacking)}",
                        tuple(sorted(lacking)),
                    )
            waiting = self._writes.waiting_layers()
            if waiting:
                # Every key arrived, yet a one-scale matrix still misses rows: some key reached it another
                # way than load() (e.g. written in place). Committing would serve its old bytes.
                raise UpdateStateError(
                    f"update {self.version!r}: {name_list(sorted(waiting))} still wait(s) for rows of a "
                    "per-tensor-scaled matrix although every key arrived: a key was written without load(); "
                    "nothing of that matrix was quantized"
                )
            t0 = time.perf_counter()
            for hook in self.state.post_update_hooks:
                hook(self.model)
            t1 = time.perf_counter()
            # Layers processed for the first time have new kernel tensors by design: not audited.
            fresh = tuple(f"{i.name}." if i.name else "" for i in self._first_processed)
            try:
                # The audit reads tensor metadata only: it runs while the device still copies.
                verify_baseline(self.model, self._baseline, fresh)
            except PointerChangedError:
                self.state.forget_views()
                raise
            t2 = time.perf_counter()
            if self.device.type == "cuda":
                # The update is done when its writes are (a kernel's error surfaces here, before commit).
                torch.cuda.synchronize(self.device)
            self._seconds["wait"] = time.perf_counter() - t2
            fp = fingerprint(self.model) if self.compute_fingerprint else None
        except BaseException as e:
            self._fail(e)
            raise
        self._seconds["hooks"] = t1 - t0
        self._seconds["verify"] = t2 - t1
        self._prepared = (missing, fp)

    def prepared_summary(self) -> dict[str, Any]:
        """What a prepared update will report (version, fingerprint, tensors, bytes, peak staging, seconds)."""
        assert self._prepared is not None
        return {"version": self.version, "fingerprint": self._prepared[1], "num_tensors": len(self._arrived),
                "num_bytes": self._num_bytes, "peak_buffered_bytes": self._peak,
                "seconds": time.perf_counter() - self._t0}

    def commit(self) -> UpdateReport:
        """Make a prepared update the model's state and return its report."""
        self._require_open()
        if self._prepared is None:
            raise UpdateStateError(f"update {self.version!r}: commit() needs a successful prepare() first")
        missing, fp = self._prepared
        # Partial means "not every tensor of the reference layout": a subset manifest that fully arrived
        # is still partial, so it never becomes the reference and heals only the layers it rewrote.
        partial = bool(missing) or bool(self._lacking_from_reference())
        for info in self._first_processed:
            info.processed = True
        if self._first_processed:  # new kernel tensors by design: the next update needs a fresh walk
            self.state.last_signatures = signatures(self.model)
        else:
            self.state.last_signatures = self._before
            self._keep_baseline = True
        self.state.mend(self._rewritten(self.state.torn_layers))
        self.state.last_abort = None
        self._close("finished")
        if not partial:
            if self.manifest is not None:
                ref = self.state.reference
                tensors = self.manifest.tensors
                # Kept as the same object while updates announce the same tensors, so the validation
                # verdict cached against it stays usable.
                if not self._announces_reference():
                    if ref is not None and len(ref) == len(self.manifest) and all(
                            r.name == m.name and r.dtype == m.dtype and r.shape == m.shape
                            for r, m in zip(ref.tensors, tensors)):
                        self.state.reference_matched = (ref, tensors)
                    else:
                        plain = all(m.checksum is None for m in tensors)
                        # Without checksums the announced entries are the layout itself: sharing them
                        # makes the next update announcing the same ones (a transport reuses them) an
                        # identity check.
                        self.state.reference = self.manifest.with_version(None) if plain else Manifest(
                            tuple(TensorMeta(m.name, m.dtype, m.shape) for m in tensors)
                        )
            elif self.state.reference is None:
                self.state.reference = Manifest(
                    tuple(TensorMeta(n, kp.dtype, kp.shape) for n, kp in self.plan.keys.items()
                          if n in self._arrived)
                )
            self.state.version = self.version
        self._seconds["total"] = time.perf_counter() - self._t0
        processed = set(self._processed_done)
        self.report = UpdateReport(
            version=self.version,
            num_tensors=len(self._arrived),
            num_bytes=self._num_bytes,
            layers_direct=tuple(sorted(self._layers_written() - processed)),
            layers_processed=tuple(self._processed_done),
            layers_per_unit=tuple(self._per_unit),
            layers_banded=tuple(self._banded),
            units_processed=self._num_units,
            per_unit_fallbacks=dict(self._unit_fallbacks),
            keys_replayed=self._replayed,
            keys_via_loader=self._via_loader,
            keys_ignored=tuple(self._ignored),
            peak_buffered_bytes=self._peak,
            spilled_bytes=self._spilled,
            budget_bytes=self.budget_bytes,
            seconds=dict(self._seconds),
            fingerprint=fp,
            partial=partial,
        )
        return self.report

    def _fail(self, exc: BaseException) -> None:
        if self._status == "open":
            self.abort(reason=f"{type(exc).__name__}: {exc}")

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Give up this update: roll back (if enabled) or mark the model torn if anything was written."""
        if self._status != "open":
            return
        for ol in list(self._open.values()):
            self._restore_objects(ol, keep_new_attrs=False)
        self._open.clear()
        self._reinstall_units()
        unrestored = self._touched
        if self.rollback:
            with torch.no_grad():
                for snaps in self._snapshots.values():
                    for live, host in snaps:
                        live.copy_(host)
            for mod, initial, attrs in reversed(self._attr_snapshots):
                for k in [k for k, v in vars(mod).items()
                          if k not in initial and not isinstance(v, torch.Tensor)]:
                    del mod.__dict__[k]
                mod.__dict__.update(attrs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            unrestored = self._touched - set(self._snapshots)
        self.state.tear(unrestored, f"update {self.version!r} failed: {reason}")
        self.state.last_abort = f"update {self.version!r} was aborted: {reason}"
        self._close("aborted")

    def _close(self, status: str) -> None:
        """End the session as ``status``: the model is free for the next update; close callbacks run."""
        self._status = status
        self.state.active = None
        # The model's write queue outlives the session: it must not keep the session (and through it
        # the model, whose weak-keyed reload state holds the queue) alive.
        self._writes.carrier = self._writes.release = self._writes.written = None
        if self._keep_baseline:  # verified at this commit: the next begin re-checks it instead of walking
            self.state.last_baseline = self._baseline
        else:  # it may reference tensors replaced by first processing (or an aborted update): let them go
            self._baseline.release()
        self._report_buffering()
        callbacks, self._on_close = self._on_close, []
        for fn in callbacks:
            fn()

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once when this session ends, finished or aborted (e.g. to undo a routing shim)."""
        self._require_open()
        self._on_close.append(fn)

    def _report_buffering(self) -> None:
        """One warning per update whose stream was out of layer order, with the bytes really held."""
        if not self._waited:
            return
        log.warning(
            "update %r: weights arrived out of layer order: up to %d bytes of model-format staging were "
            "held at once (%d bytes on the device, %d bytes in host memory; budget %d bytes) for "
            "layers %s; send every tensor of a layer before the next layer's",
            self.version, self._held_peak, self._peak, self._host_peak, self.budget_bytes,
            name_list(self._waited),
        )

    def _layers_written(self) -> set[str]:
        """Every layer a key of this update went into."""
        # Per layer rather than per key: a MoE update has ~40x more keys than layers.
        arrived = self._arrived
        return {layer for layer, keys in self.plan.layer_keys.items() if not keys.isdisjoint(arrived)}

    def _lacking_from_reference(self) -> list[str]:
        """Tensors of the reference layout this update did not bring (ignored keys excluded)."""
        if self._all_expected_arrived() and self._announces_reference():
            return []
        return lacking_from_reference(self.state, self.plan, self._arrived)

    def _all_expected_arrived(self) -> bool:
        """Whether every expected key arrived, known by counting: under a manifest, load() takes only
        announced names and mark_applied counts the others, so while there are none the arrived keys
        are a subset of the expected ones and equal counts mean equal sets (6k-key MoE updates ask this
        several times at finish; each set comparison is a pass over every name)."""
        return (self._announced is not None and self.expected is not None and not self._unannounced_applied
                and len(self._arrived) == len(self.expected))

    def _announces_reference(self) -> bool:
        """Whether this update's manifest announces exactly the reference's entries (the same entries
        object, or one the last commit found equal to them)."""
        ref, manifest = self.state.reference, self.manifest
        if ref is None or manifest is None:
            return False
        matched = self.state.reference_matched
        return ref.tensors is manifest.tensors or (
            matched is not None and matched[0] is ref and matched[1] is manifest.tensors)

    def _rewritten(self, layers: Iterable[str]) -> set[str]:
        """Of ``layers``, those this update wrote whole (see :func:`.validation.rewritten_layers`)."""
        return rewritten_layers(self.state, self.plan, self._arrived, layers)
