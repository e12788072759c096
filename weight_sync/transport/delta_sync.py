"""Delta sync: what each side keeps as the base of the next update, and how a delta update is agreed.

With ``TransportConfig(delta=True)``, ``WeightSender.send`` ships a tensor as its exact byte changes
against the version the engines last committed (``transport/delta.py``) whenever it can:

- **Sender** (:class:`DeltaSender`): keeps a copy of every tensor of the last update all engines of
  its group committed, with that version and each receiver's fingerprint, on the tensors' own device
  (``delta_base="device"``) or in host memory (``"pinned"``: page-locked when CUDA is available). Cost:
  one copy of the sent weights (the wire dtype, e.g. bf16). A full update records the base as it
  streams; a delta update first encodes every tensor (the manifest must carry encoded sizes before any
  data), moving the base to the new bytes as it goes, and the base is a committed version again only
  when every engine commits. ``send()`` drives one update; :meth:`DeltaSender.begin`,
  :meth:`~DeltaSender.refused` and :meth:`~DeltaSender.committed` are its phases for callers that
  drive start / update / finish themselves (vLLM's trainer engine).
- **Manifest**: the start header carries ``delta``: ``mode`` ('full': record the base; 'delta'),
  ``base_version``, ``base_fingerprints`` (by receiver rank) and ``wire`` (encoded bytes per tensor).
  The model manifest is the ordinary one (validated against the plan as usual); the buckets carry the
  encodings, one uint8 tensor per tensor, so bucket layout, trailers and checksums are unchanged.
- **Receiver** (:class:`ReceiverDeltaBase`, :class:`DeltaSession`): before any write, a delta is
  checked against the engine's committed state: the base version must equal the engine's committed
  version and the base fingerprint its fingerprint, and the base must cover every tensor, else the
  start is refused with :class:`~weight_sync.errors.DeltaBaseError` on every rank (the engine
  untouched), and the sender falls back to a full update of the same weights on its own. A delta's
  keys are applied in place where the plan allows (``weight_sync.reload.delta_apply``: changed values
  scattered into direct layers' live storage, quantized layers requantized only where the changes
  reach, from model-format copies the engine keeps); the other keys are decoded into a
  checkpoint-format host copy and loaded whole through the ordinary session. Transactions, rollback
  and torn rules, the fingerprint are those of a full update. An update that fails after writing
  anything drops the base (the next delta is refused, so the fallback full update re-establishes it).

Limitations: ``send()`` and vLLM's trainer engine only (separate start/update/finish calls send full
updates and drop the sender's base); not with zero-copy or disk.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from weight_sync import native
from weight_sync.errors import DeltaBaseError, DuplicateTensorError, ManifestError, TransportError
from weight_sync.manifest import Manifest, TensorMeta
from weight_sync.reload.delta_apply import DeltaApplier, InPlaceUpdate
from weight_sync.transport.delta import apply_delta_, encode_deltas

__all__ = [
    "DELTA_BASES",
    "DeltaSender",
    "DeltaSession",
    "DeltaUpdate",
    "ReceiverDeltaBase",
    "is_delta_refusal",
    "wire_manifest",
]

log = logging.getLogger(__name__)

# A sender encodes its CUDA tensors in groups of about this many bytes, one device sync per group
# (transport/delta_encode_group.py): while a group is encoded, the device holds two staging copies of
# its bytes and a byte per element. Each group costs ~2 ms of host time on an H200 host: 256 MB groups
# made the encode of a 16 GB model 140 ms against a 10 ms compare pass.
_ENCODE_GROUP_BYTES = 1 << 30

DELTA_BASES = ("device", "pinned")


def wire_manifest(manifest: Manifest, wire_nbytes: list[int]) -> Manifest:
    """The manifest the buckets are cut from in a delta update: each tensor as its uint8 encoding."""
    if len(wire_nbytes) != len(manifest):
        raise ManifestError(f"delta header lists {len(wire_nbytes)} encoded sizes for {len(manifest)} tensors")
    return manifest.as_bytes(wire_nbytes)


def is_delta_refusal(error: BaseException) -> bool:
    """Whether an agreed start failure is receivers refusing a delta's base (and nothing else)."""
    failed = getattr(error, "statuses", None)
    return bool(failed) and all(s.error_type == "DeltaBaseError" for s in failed)  # type: ignore[union-attr]


def _same_layout(t: torch.Tensor | None, meta: TensorMeta) -> bool:
    return t is not None and t.dtype == meta.dtype and tuple(t.shape) == tuple(meta.shape)


class DeltaSender:
    """The sender's base (last committed version of its engine group) and the delta ``send``."""

    def __init__(self, *, base: str = "pinned", chunk_elems: int) -> None:
        self.base_kind = base
        self.chunk_elems = chunk_elems
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: Any = None  # None: no base every engine committed
        self.fingerprints: list[str | None] = []
        self.last_stats: dict[str, Any] = {}
        # Host encodings of one delta update at a time, kept across updates (their page faults cost
        # more than the encode on a VM host); reset when the next update begins.
        self.arena = native.HostArena()

    @property
    def nbytes(self) -> int:
        """Memory the base holds (bytes)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def forget(self) -> None:
        """No usable base any more (an update the base did not follow); the memory is kept for reuse."""
        self.version = None

    def _slot(self, name: str, t: torch.Tensor) -> torch.Tensor:
        slot = self.tensors.get(name)
        if slot is None or slot.dtype != t.dtype or slot.shape != t.shape:
            if self.base_kind == "device":
                slot = torch.empty_like(t, memory_format=torch.contiguous_format)
            else:
                slot = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self.tensors[name] = slot
        return slot

    def send(self, sender: Any, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
             manifest: Manifest | Iterable[TensorMeta], version: Any) -> Any:
        """``WeightSender.send`` with delta: a delta on top of the committed base when there is one that
        covers this manifest, a full update (recording the base) otherwise or when receivers refuse."""
        if not isinstance(manifest, Manifest):
            manifest = Manifest(tuple(manifest), version=version)
        update = self.begin(named_tensors, manifest, version)
        try:
            sender.start_weight_update(manifest, version, delta=update.info)
        except TransportError as e:
            update = self.refused(update, e)
            sender.start_weight_update(manifest, version, delta=update.info)
        sender.update_weights(update.items())
        return self.committed(update, sender.finish_weight_update())

    def begin(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
              manifest: Manifest, version: Any) -> DeltaUpdate:
        """The first step of one update driven phase by phase (``send()``, or vLLM's separate start /
        update / finish calls): a delta encoded against the committed base when one covers
        ``manifest``, else a full update that records the base. Its ``info`` is the start header's
        ``delta`` record; ``items()`` what ``update_weights`` sends; :meth:`committed` its end."""
        pairs = _pairs(named_tensors, manifest)
        reason = self._unusable(manifest)
        if reason is not None:
            return self._full(pairs, manifest, reason)
        # The encode moves the base to the new bytes as it goes (only the changed elements are
        # written): until every engine commits, the base is no committed version (version None).
        committed, fingerprints = self.version, self.fingerprints
        self.version = None
        self.arena.reset()  # the last update's encodings are sent (or were refused)
        encodings, stats = self._encode(pairs, manifest)
        info = {"mode": "delta", "base_version": committed, "base_fingerprints": fingerprints,
                "wire": [int(e.numel()) for e in encodings]}
        return DeltaUpdate(manifest, info, list(zip(manifest.names, encodings)), dict(stats, mode="delta"))

    def refused(self, update: DeltaUpdate, error: TransportError) -> DeltaUpdate:
        """After a failed start: the full update of the same weights when the engines refused the
        delta's base (re-raises anything else)."""
        if update.info.get("mode") != "delta" or not is_delta_refusal(error):
            self.forget()
            raise error
        log.warning("[rank 0] delta update refused by the engines (%s); sending it in full", error)
        manifest = update.manifest
        # The base already holds the new weights: they are what the full update sends.
        return self._full(((n, self.tensors[n]) for n in manifest.names), manifest, str(error))

    def committed(self, update: DeltaUpdate, report: Any) -> Any:
        """Every engine committed ``update``: the base is that version; the report says how it went."""
        self.version, self.fingerprints = report.version, list(report.fingerprints)
        self.last_stats = update.stats
        return replace(report, delta=self.last_stats)

    def _unusable(self, manifest: Manifest) -> str | None:
        if self.version is None:
            return "no base committed by every engine yet"
        if len(self.tensors) != len(manifest) or not all(_same_layout(self.tensors.get(m.name), m) for m in manifest):
            return "the manifest differs from the base's tensors"
        return None

    def _encode(self, pairs: Iterator[tuple[str, torch.Tensor]], manifest: Manifest) -> tuple[list[torch.Tensor], dict[str, Any]]:
        encodings: list[torch.Tensor] = []
        changed = numel = 0
        group: list[tuple[torch.Tensor, torch.Tensor]] = []
        group_bytes = 0

        def encode_group() -> None:
            nonlocal changed, numel
            # Encoded together (one device sync per group on CUDA), the bases moved to the new bytes.
            encoded = encode_deltas(group, chunk_elems=self.chunk_elems, advance=True, arena=self.arena)
            for (t, _), (enc, k) in zip(group, encoded):
                changed, numel = changed + k, numel + t.numel()
                encodings.append(enc)
            group.clear()

        for meta in manifest:
            name, t = next(pairs)
            _check(name, t, meta)
            group.append((t, self.tensors[name]))
            if t.device.type != "cpu":
                # Host tensors wait for the end: encoded together, on several threads (no device
                # staging memory to bound).
                group_bytes += t.numel() * t.element_size()
            if group_bytes >= _ENCODE_GROUP_BYTES:
                encode_group()
                group_bytes = 0
        encode_group()
        _expect_end(pairs, manifest)
        wire = sum(e.numel() for e in encodings)
        return encodings, {"num_changed": changed, "numel": numel, "changed_fraction": changed / max(numel, 1),
                           "wire_bytes": wire, "plain_bytes": manifest.nbytes}

    def _full(self, pairs: Iterator[tuple[str, torch.Tensor]], manifest: Manifest, reason: str) -> DeltaUpdate:
        self.version = None  # the base is overwritten as the tensors stream: usable again only on commit
        keep = set(manifest.names)
        for stale in [n for n in self.tensors if n not in keep]:
            del self.tensors[stale]

        def recorded() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in pairs:
                slot = self._slot(name, t)
                if slot is not t:  # the fallback after a refused delta sends the base itself
                    slot.copy_(t)
                yield name, t

        return DeltaUpdate(manifest, {"mode": "full"}, recorded(),
                           {"mode": "full", "reason": reason, "wire_bytes": manifest.nbytes,
                            "plain_bytes": manifest.nbytes})


class DeltaUpdate:
    """One update as :class:`DeltaSender` plans it: the start header's ``delta`` record, the (name,
    tensor) pairs ``update_weights`` sends (encodings, or the full tensors as they stream), its stats."""

    def __init__(self, manifest: Manifest, info: dict[str, Any],
                 pairs: list[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]],
                 stats: dict[str, Any]) -> None:
        self.manifest = manifest
        self.info = info
        self.pairs = pairs
        self.stats = stats

    def items(self) -> list[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]]:
        return self.pairs


def _pairs(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(named, Mapping):
        return ((m.name, named[m.name]) for m in manifest)
    return iter(named)


def _check(name: str, t: torch.Tensor, meta: TensorMeta) -> None:
    if name != meta.name or not _same_layout(t, meta):
        raise ManifestError(
            f"delta send: expected {meta.name} {tuple(meta.shape)} {meta.dtype} next, got {name} "
            f"{tuple(t.shape)} {t.dtype}"
        )


def _expect_end(pairs: Iterator[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
    extra = next(pairs, None)
    if extra is not None:
        raise ManifestError(f"delta send: the source yields {extra[0]!r} after the manifest's {len(manifest)} tensors")


class ReceiverDeltaBase:
    """An engine rank's base for deltas: what its last committed update left, kept in three forms.

    Keys applied in place need nothing beyond the engine's own tensors (direct layers) or a
    model-format copy of a quantized weight (``applier``, see ``weight_sync.reload.delta_apply``);
    keys on the session path keep a checkpoint-format copy here (``tensors``), decoded into and loaded
    whole. ``layouts`` names every tensor the base covers.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self.applier = DeltaApplier()
        self.version: Any = None
        self.fingerprint: str | None = None
        self.valid = False
        self.last_stats: dict[str, Any] = {}

    @property
    def nbytes(self) -> int:
        """Memory the base holds beyond the engine's tensors (bytes)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values()) + self.applier.nbytes

    def check(self, info: dict[str, Any], manifest: Manifest, rank: int, committed_version: Any,
              committed_fingerprint: str | None) -> Manifest | None:
        """Refuse a delta whose base is not this engine's committed state (raises before any write);
        returns the wire manifest to cut the buckets from (None for a full update)."""
        if info.get("mode") != "delta":
            return None
        base_version = info.get("base_version")
        fps = info.get("base_fingerprints") or []
        base_fp = fps[rank - 1] if len(fps) >= rank else None
        problems = []
        if not self.valid:
            problems.append("no delta base is kept (no full update recorded it, or a later update failed)")
        elif self.version != base_version:
            problems.append(f"the kept base is version {self.version!r}")
        if committed_version != base_version:
            problems.append(f"the engine's committed version is {committed_version!r}")
        if base_fp is not None and committed_fingerprint is not None and base_fp != committed_fingerprint:
            problems.append(f"the engine's fingerprint is {committed_fingerprint[:16]}, the delta's base "
                            f"{base_fp[:16]}")
        missing = [m.name for m in manifest if self.layouts.get(m.name) != (m.dtype, tuple(m.shape))]
        if self.valid and missing:
            problems.append(f"the base lacks {len(missing)} tensor(s) of this layout, first {missing[0]!r}")
        if problems:
            raise DeltaBaseError(
                f"[rank {rank}] delta update {manifest.version!r}: expected the engine at base version "
                f"{base_version!r}; " + "; ".join(problems)
            )
        return wire_manifest(manifest, info.get("wire") or [])

    def take(self, name: str, t: torch.Tensor, mode: str) -> torch.Tensor:
        """The full tensor to load for what arrived as ``t``: a delta is applied to the checkpoint-format
        copy (and the copy returned), a full tensor is recorded into it (and returned as it came)."""
        if mode == "delta":
            base = self.tensors.get(name)
            if base is None:
                raise DeltaBaseError(f"{name}: a delta on the session path needs the checkpoint-format copy "
                                     "the last full update records, found none")
            apply_delta_(base, t, positions=False)  # the session needs the tensor, not the positions
            return base
        slot = self.tensors.get(name)
        if slot is None or slot.dtype != t.dtype or slot.shape != t.shape:
            slot = self.tensors[name] = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        slot.copy_(t)
        return t

    def commit(self, version: Any, fingerprint: str | None,
               layouts: dict[str, tuple[torch.dtype, tuple[int, ...]]] | None = None,
               copied: set[str] | None = None) -> None:
        """The update became the engine's state; a full one (``layouts``) replaces what the base covers
        and keeps checkpoint-format copies of the ``copied`` keys only."""
        if layouts is not None:
            self.layouts = layouts
            for stale in [n for n in self.tensors if copied is None or n not in copied]:
                del self.tensors[stale]
        self.version, self.fingerprint, self.valid = version, fingerprint, True

    def invalidate(self) -> None:
        self.valid = False
        self.applier.forget()


class DeltaSession:
    """An update session seen through the delta base: a delta's keys are applied in place where the
    plan allows (``weight_sync.reload.delta_apply``), the rest decoded and loaded whole; commit and
    abort move the base.

    Both finishes move the base: ``finish()`` and the two-phase ``prepare()`` + ``commit()``. Everything
    else (missing(), rollback, report, ...) is the wrapped session's. The fingerprint is computed here
    (from checksums moved by the changed words on a delta), in place of the session's.
    """

    def __init__(self, session: Any, base: ReceiverDeltaBase, mode: str) -> None:
        object.__setattr__(self, "_inner", session)
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_mode", mode)
        object.__setattr__(self, "_dirty", False)  # whether the base was written by this update
        object.__setattr__(self, "_want_fp", bool(session.compute_fingerprint))
        object.__setattr__(self, "_fp", None)
        object.__setattr__(self, "_layouts", {})
        object.__setattr__(self, "_copied", set())
        object.__setattr__(self, "_through", 0)
        session.compute_fingerprint = False  # computed by the in-place update (prepare)
        object.__setattr__(self, "_update", InPlaceUpdate(base.applier, session, mode))

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Any:
        object.__setattr__(self, "_dirty", True)
        if self._mode == "full":
            self._base.invalidate()
        update, manifest = self._update, self._inner.manifest
        through = []
        in_place: list[tuple[str, torch.Tensor, int, torch.dtype, Any]] = []
        queued: set[str] = set()
        try:
            for name, t in tensors:
                targets = update.route(name)
                if self._mode == "delta":
                    if targets is None or manifest is None or name not in manifest:
                        through.append((name, self._base.take(name, t, "delta")))
                        continue
                    if name in self._inner._arrived or name in queued:
                        raise DuplicateTensorError(f"{name}: arrived twice in update {self._inner.version!r}")
                    queued.add(name)
                    meta = manifest[name]
                    in_place.append((name, t, math.prod(meta.shape), meta.dtype, targets))
                    continue
                if targets is None:
                    self._base.take(name, t, "full")
                    self._copied.add(name)
                else:
                    update.record(name, t, targets)
                self._layouts[name] = (t.dtype, tuple(t.shape))
                through.append((name, t))
            # The call's in-place deltas together: decoded and checked as one batch, then written (on a
            # device, with the next calls' deltas up to the batch size, at the latest in prepare()).
            update.stage(in_place)
            object.__setattr__(self, "_through", self._through + len(through))
            return self._inner.load(through) if through else None
        except BaseException as e:
            self._fail(e)
            raise

    def finish(self) -> Any:
        self.prepare()
        return self.commit()

    def prepare(self) -> Any:
        """The two-phase finish's first half (everything that can fail); the base moves only on commit."""
        try:
            self._update.apply_staged()  # the session's prepare checks every key arrived
            out = self._inner.prepare()
            if self._want_fp:
                object.__setattr__(self, "_fp", self._update.fingerprint(self._inner.model))
            return out
        except BaseException as e:
            self._fail(e)
            raise

    def prepared_summary(self) -> dict[str, Any]:
        out = dict(self._inner.prepared_summary())
        if self._want_fp:
            out["fingerprint"] = self._fp
        return out

    def commit(self) -> Any:
        try:
            report = self._inner.commit()
        except BaseException as e:
            self._fail(e)
            raise
        if self._want_fp:
            report = replace(report, fingerprint=self._fp)
            self._inner.report = report
        self._update.commit()
        full = self._mode == "full"
        self._base.commit(report.version, report.fingerprint, self._layouts if full else None,
                          self._copied if full else None)
        self._base.last_stats = {"mode": self._mode, "in_place": self._update.num_in_place,
                                 "requantized": self._update.num_requantized,
                                 "requantized_whole": self._update.num_whole, "through_session": self._through,
                                 "seconds": dict(self._update.seconds, total=report.seconds.get("total", 0.0))}
        return report

    def _fail(self, exc: BaseException) -> None:
        self.abort(f"{type(exc).__name__}: {exc}")

    def abort(self, reason: str) -> Any:
        # The session first: its rollback restores whole layers from snapshots that may postdate
        # in-place writes of this update; the in-place undo then restores the elements it wrote.
        try:
            return self._inner.abort(reason)
        finally:
            self._update.undo(f"update {self._inner.version!r} failed: {reason}")
            if self._dirty:
                self._base.invalidate()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)
