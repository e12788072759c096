"""One engine update fed by several senders: an expert-parallel trainer's ranks each send their own part.

A transport has one sender. A trainer whose ranks hold disjoint parts of the model (expert parallel:
each rank holds whole experts, rank 0 also the replicated tensors) would otherwise gather everything
onto one rank to send it. ``JoinedUpdate`` lets every trainer rank keep its own ``WeightSender`` and
the engine one ``WeightReceiver`` per trainer rank, all feeding **one** update session, so the
engine sees one transaction: manifest first, all or nothing, one version.

- **Start.** Each part's manifest is validated when it arrives against the engine's plan (names,
  shapes, dtypes: a dry run, nothing is written; a bad part is refused to its sender naming the
  tensor). Once every part has started, the real session begins with the
  union of the parts in block order; names announced by two parts are refused.
- **Data.** Each part's tensors go into the real session as they arrive, checked against that
  part's manifest. Parts arrive one after the other, so a block's experts come in two visits:
  layers complete by their keys (expert-granular layers by expert), and the budget and spill rule
  bound what waits.
- **Finish.** The first part to finish prepares the real session (completeness of every part, the
  pointer audit, the fingerprint) before its status exchange; the real session commits at the first
  part's commit, and later parts report the same report. So the engine commits once all parts'
  data arrived and was verified by its buckets' checksums; a part whose sender fails only at its
  finish is told so, but the engine already holds the complete update.
- **Failure.** Any part's abort aborts the real session (rolled back or torn by the usual rules);
  the other parts' later loads fail, and their senders are told in their own status exchanges.

:func:`receive_joined` drives the receivers in this order (all starts, each part's calls, all finishes),
for senders that send their part in one ``update_weights`` call each (``WeightSender.send``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from weight_sync.errors import IncompleteUpdateError, ManifestError, UpdateStateError
from weight_sync.layers import order_by_block
from weight_sync.manifest import Manifest, TensorMeta

__all__ = ["JoinedUpdate", "PartSession", "receive_joined"]


class JoinedUpdate:
    """The shared state of one update made of ``num_parts`` senders' parts; ``part(k)`` is a receiver target.

    target: the engine (``begin_update(manifest, **options)``, e.g. ReferenceEngine) or an nn.Module.
    """

    def __init__(self, target: Any, num_parts: int) -> None:
        if num_parts < 1:
            raise ValueError(f"num_parts must be >= 1, got {num_parts}")
        self.target = target
        self.model: nn.Module = getattr(target, "model", target)
        self.num_parts = num_parts
        self.last_report: Any = getattr(target, "last_report", None)
        self._reset()

    def _reset(self) -> None:
        self.manifests: dict[int, Manifest] = {}
        self.session: Any = None
        self.report: Any = None
        self.failed: str | None = None
        self.prepared = False
        self.parts: dict[int, PartSession] = {}

    def part(self, k: int) -> _PartTarget:
        """The target to give the receiver of trainer part ``k`` (in ``[0, num_parts)``)."""
        if not 0 <= k < self.num_parts:
            raise ValueError(f"part must be in [0, {self.num_parts}), got {k}")
        return _PartTarget(self, k)

    def _begin_engine(self, manifest: Manifest, options: dict[str, Any]) -> Any:
        begin = getattr(self.target, "begin_update", None)
        if callable(begin):
            return begin(manifest, **options)
        from weight_sync.reload.api import begin_update

        return begin_update(self.model, manifest, **options)

    def begin_part(self, k: int, manifest: Manifest, options: dict[str, Any]) -> PartSession:
        if k in self.manifests or self.report is not None or self.failed is not None:
            self._reset()  # a new update: the previous one ended (committed or aborted)
        self._validate_part(k, manifest)
        others = {n: j for j, m in self.manifests.items() for n in m.names}
        dup = [n for n in manifest.names if n in others]
        if dup:
            raise ManifestError(
                f"joined update: part {k} announces {dup[0]!r}, which part {others[dup[0]]} announces "
                f"too ({len(dup)} name(s) in both); every tensor must come from exactly one trainer rank"
            )
        self.manifests[k] = manifest
        part = self.parts[k] = PartSession(self, k, manifest)
        if len(self.manifests) == self.num_parts:
            metas: dict[str, TensorMeta] = {m.name: m for man in self.manifests.values() for m in man}
            union = Manifest(tuple(metas[n] for n in order_by_block(list(metas))), version=manifest.version)
            self.session = self._begin_engine(union, options)
        return part

    def _validate_part(self, k: int, manifest: Manifest) -> None:
        """Refuse, before any write, a part whose tensors the engine's plan does not take (names, shapes,
        dtypes). Coverage (every tensor of a processed layer) is the union's, checked when it begins."""
        from weight_sync.reload.plan import Plan
        from weight_sync.reload.state import get_state
        from weight_sync.reload.validation import check_against_plan, plan_missing

        state = get_state(self.model, create=True)
        if state.plan is None:
            state.plan = Plan()
        problems = {n: str(e) for n, e in plan_missing(self.model, state, state.plan, list(manifest)).items()}
        for m in manifest:
            kp = state.plan.keys.get(m.name)
            msg = None if kp is None or m.name in problems else check_against_plan(kp, m.shape, m.dtype)
            if msg:
                problems[m.name] = msg
        if problems:
            first = list(problems.values())
            raise ManifestError(f"joined update: part {k} rejected before any write ({len(first)} problem(s)): "
                                + "; ".join(first[:5]))

    def live_session(self, k: int) -> Any:
        if self.failed is not None:
            raise UpdateStateError(f"joined update: part {k}: the update already failed: {self.failed}")
        if self.session is None:
            raise UpdateStateError(
                f"joined update: part {k} sends data before all {self.num_parts} parts started "
                f"({sorted(self.manifests)} did); start every part's update first"
            )
        return self.session

    def prepare(self, k: int) -> None:
        session = self.live_session(k)
        if self.prepared:
            return
        missing = {j: p.missing() for j, p in self.parts.items()}
        incomplete = {j: m for j, m in missing.items() if m}
        if incomplete:
            j, names = next(iter(incomplete.items()))
            raise IncompleteUpdateError(
                f"joined update: part {j} lacks {len(names)} announced tensor(s), e.g. {names[:3]}; the engine "
                "commits only once every part arrived", tuple(names))
        session.prepare()
        self.prepared = True

    def commit(self, k: int) -> Any:
        if self.report is None:
            self.report = self.live_session(k).commit()
            self.last_report = self.report
            if hasattr(self.target, "last_report"):
                self.target.last_report = self.report
        return self.report

    def abort(self, k: int, reason: str) -> None:
        if self.failed is None:
            self.failed = f"part {k}: {reason}"
        if self.session is not None and self.report is None:
            session, self.session = self.session, None
            session.abort(f"joined update, part {k}: {reason}")


class _PartTarget:
    """What one receiver sees as its engine: the joined update's model and a part-scoped begin."""

    def __init__(self, joined: JoinedUpdate, k: int) -> None:
        self.joined = joined
        self.k = k
        self.model = joined.model

    @property
    def last_report(self) -> Any:
        return self.joined.last_report

    @last_report.setter
    def last_report(self, report: Any) -> None:
        self.joined.last_report = report

    def begin_update(self, manifest: Manifest, **options: Any) -> PartSession:
        return self.joined.begin_part(self.k, manifest, options)


class PartSession:
    """One part's view of the joined session: its names only, the shared session's lifecycle."""

    def __init__(self, joined: JoinedUpdate, k: int, manifest: Manifest) -> None:
        self.joined = joined
        self.k = k
        self.names = frozenset(manifest.names)
        self.arrived: set[str] = set()
        self.rollback = False

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        session = self.joined.live_session(self.k)
        items = list(named_tensors)
        for name, _ in items:
            if name not in self.names:
                raise ManifestError(f"joined update: part {self.k} sent {name!r}, which its manifest did not announce")
        session.load(items)
        self.arrived.update(n for n, _ in items)

    def missing(self) -> list[str]:
        return sorted(self.names - self.arrived)

    def prepare(self) -> None:
        self.joined.prepare(self.k)

    def prepared_summary(self) -> dict[str, Any]:
        return dict(self.joined.live_session(self.k).prepared_summary())

    def commit(self) -> Any:
        return self.joined.commit(self.k)

    def finish(self) -> Any:
        self.prepare()
        return self.commit()

    def abort(self, reason: str = "aborted by the caller") -> None:
        self.joined.abort(self.k, reason)


def receive_joined(receivers: Sequence[Any], timeout_s: float | None = None) -> Any:
    """Run one joined update over ``receivers`` (``WeightReceiver``s on ``JoinedUpdate.part(k)``).

    Every phase runs on every receiver even after one failed, so no sender is left waiting; the first
    error is raised at the end. Each sender sends its part in one ``update_weights`` call.
    """
    first: BaseException | None = None
    report = None
    for phase in ("start", "call", "finish"):
        for r in receivers:
            try:
                if phase == "start":
                    r.start_weight_update(timeout_s)
                elif phase == "call":
                    if r.is_open:
                        r.update_weights()
                elif r.is_open:
                    report = r.finish_weight_update()
            except BaseException as e:
                first = first or e
    if first is not None:
        raise first
    return report
