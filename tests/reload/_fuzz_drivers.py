"""The lifecycle fuzzer's drivers: one step of the reload lifecycle at a time, each checked against the world.

A driver owns one live model (a :class:`ReferenceEngine` of one flavor, or a plain ``nn.Module``) and the
:class:`World` it must agree with. Its rule methods draw their parameters through a :class:`Draw` --
hypothesis' ``data`` object in the state machines, a seeded ``random.Random`` in the TP=2 replay and the
long run -- so every machine runs the same rules. Each rule predicts its outcome (commit, or which error
naming which tensor), runs it, compares, and updates the world; :meth:`Driver.check` then holds the
engine to the promise (one committed version bitwise, or refusal).
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from tests.reload._fuzz_world import (
    FRESH,
    GEN_PROMPT,
    GEN_TOKENS,
    PROMPT,
    SEEDS,
    BadUpdateAccepted,
    Fresh,
    GoodUpdateRejected,
    Hygiene,
    MixedVersionsServed,
    RefusalWithoutReason,
    ServedDuringOpenUpdate,
    ServingMismatch,
    SessionLeft,
    ShimLeft,
    TornAfterGoodUpdate,
    VersionKey,
    World,
    WrongError,
    assets,
    base_key,
    check_pointers,
    describe_key,
    kernel_differences,
    layer_of,
    merged_key,
    snapshot_kernel,
    version_items,
)
from weight_sync import (
    DuplicateTensorError,
    IncompleteUpdateError,
    LayoutMismatchError,
    Manifest,
    ManifestError,
    SourceError,
    TornModelError,
    UnknownTensorError,
    UpdateStateError,
    WeightSyncError,
    begin_update,
    finalize_layerwise_processing,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
    reload_weights,
)
from weight_sync.layers.tensors import signatures
from weight_sync.reload import torn_reason
from weight_sync.reload.state import get_state

T = TypeVar("T")

# Every rule and fault the drivers ran, by kind (the long run reports these).
STATS: Counter[str] = Counter()

FAULTS = ("shape", "dtype", "unknown", "duplicate", "missing")
UNKNOWN_NAMES = ("model.layers.7.mlp.up_proj.weight", "model.layers.0.mlp.nonsense.weight")
# A sparse block's own unknown names: an expert id past the model's 8, a projection experts lack.
MOE_UNKNOWN_NAMES = (*UNKNOWN_NAMES, "model.layers.1.mlp.experts.8.down_proj.weight",
                     "model.layers.0.mlp.experts.2.o_proj.weight")
NO_MANIFEST_ERRORS = {
    "shape": LayoutMismatchError, "dtype": LayoutMismatchError, "unknown": UnknownTensorError,
    "duplicate": DuplicateTensorError, "missing": IncompleteUpdateError,
}


class InjectedFailure(RuntimeError):
    """What a failing weights source or a crashing caller raises."""


# ---------------------------------------------------------------------------------------- draws
class Draw:
    """Where a rule's parameters come from."""

    def choice(self, label: str, options: Sequence[T]) -> T:
        raise NotImplementedError

    def integer(self, label: str, lo: int, hi: int) -> int:
        raise NotImplementedError

    def subset(self, label: str, options: Sequence[T]) -> list[T]:
        """A non-empty subset, in the options' order."""
        raise NotImplementedError


class HypothesisDraw(Draw):
    def __init__(self, data: Any) -> None:
        self.data = data

    def choice(self, label, options):
        from hypothesis import strategies as st

        return self.data.draw(st.sampled_from(list(options)), label=label)

    def integer(self, label, lo, hi):
        from hypothesis import strategies as st

        return self.data.draw(st.integers(lo, hi), label=label)

    def subset(self, label, options):
        from hypothesis import strategies as st

        picked = self.data.draw(st.sets(st.sampled_from(list(options)), min_size=1), label=label)
        return [o for o in options if o in picked]


class RandomDraw(Draw):
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def choice(self, label, options):
        return self.rng.choice(list(options))

    def integer(self, label, lo, hi):
        return self.rng.randint(lo, hi)

    def subset(self, label, options):
        k = self.rng.randint(1, len(options))
        picked = set(self.rng.sample(list(options), k))
        return [o for o in options if o in picked]


# ---------------------------------------------------------------------------------------- streams
def _reorder(draw: Draw, items: list) -> list:
    order = draw.choice("order", ("stored", "reversed", "shuffled"))
    if order == "reversed":
        return items[::-1]
    if order == "shuffled":
        items = list(items)
        random.Random(draw.integer("shuffle_seed", 0, 2**16)).shuffle(items)
    return list(items)


def _wire(draw: Draw, items: list) -> list:
    """The tensors as the trainer sends them: as stored, or cast to float32 (float -> float is allowed
    and bf16 -> fp32 -> bf16 is exact, so the committed bytes are the same)."""
    if draw.choice("wire_dtype", ("native", "float32")) == "float32":
        return [(n, t.float()) for n, t in items]
    return items


class Fault:
    """A fault injected into a stream: what it is, where it sits, which error it must raise."""

    def __init__(self, kind: str, index: int | None, name: str) -> None:
        self.kind, self.index, self.name = kind, index, name


def inject(draw: Draw, items: list, kind: str, unknown_names: Sequence[str] = UNKNOWN_NAMES
           ) -> tuple[list, Fault]:
    items = list(items)
    k = draw.integer("fault_at", 0, len(items) - 1)
    name, t = items[k]
    if kind == "shape":
        items[k] = (name, torch.zeros((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype))
        return items, Fault(kind, k, name)
    if kind == "dtype":
        items[k] = (name, torch.zeros(t.shape, dtype=torch.int32))
        return items, Fault(kind, k, name)
    if kind == "unknown":
        bad = draw.choice("unknown_name", unknown_names)
        items.insert(k, (bad, torch.zeros(256, 128, dtype=torch.bfloat16)))
        return items, Fault(kind, k, bad)
    if kind == "duplicate":
        k = max(k, 1)
        j = draw.integer("duplicate_of", 0, k - 1)
        items.insert(k, items[j])
        return items, Fault(kind, k, items[j][0])
    if kind == "missing":
        del items[k]
        return items, Fault(kind, None, name)
    raise AssertionError(kind)


def manifest_of(items: list) -> Manifest:
    """A truthful manifest of ``items`` (names once: a duplicate is a fault of the data, not of it)."""
    seen, unique = set(), []
    for n, t in items:
        if n not in seen:
            seen.add(n)
            unique.append((n, t))
    return Manifest.from_named_tensors(unique)


def chunks(draw: Draw, items: list) -> list[list]:
    n = draw.integer("num_chunks", 1, min(4, max(1, len(items))))
    cuts = sorted({0, len(items), *(draw.integer("cut", 0, len(items)) for _ in range(n - 1))})
    return [items[a:b] for a, b in itertools.pairwise(cuts)]


def as_call_arg(draw: Draw, chunk: list) -> Any:
    """What one ``load`` call gets: a list (a network bucket: may lend its memory) or a generator."""
    if draw.choice("call_arg", ("list", "generator")) == "list":
        return list(chunk)
    return (item for item in chunk)


def failing_source(items: list, after: int) -> Iterator:
    yield from items[:after]
    raise InjectedFailure(f"trainer died after {after} tensors")


# ---------------------------------------------------------------------------------------- drivers
class Driver:
    """One live model, its world, and the lifecycle rules; subclasses say what the model is."""

    flavor: str
    arch: str = "qwen3"  # whose checkpoints (assets) a path route reads
    unknown_names: Sequence[str] = UNKNOWN_NAMES  # what an injected unknown-name fault sends
    diagnose: bool = True  # name which base version each differing tensor holds (builds fresh loads)
    serves: bool = False  # has generate/logits that must refuse when torn or mid-update
    processed_layers: frozenset[str] = frozenset()  # layers that need all their keys in every update

    def __init__(self) -> None:
        self.log: list[tuple[str, dict]] = []
        self.session: Any = None
        self.open: dict[str, Any] = {}
        self.hygiene = Hygiene.take()
        self.model = self.build_model()
        self.names: tuple[str, ...] = self.version_names()
        self.world = World(base_key(0, self.names))
        self.baseline = signatures(self.model)

    # ---- what subclasses provide
    def build_model(self) -> nn.Module: ...
    def version_names(self) -> tuple[str, ...]: ...
    def table(self) -> dict[int, dict[str, torch.Tensor]]: ...
    def build_fresh(self, key: VersionKey) -> Fresh: ...
    def layer(self, name: str) -> str: ...

    def do_reload(self, **kw: Any) -> Any:
        return reload_weights(self.model, **kw)

    def do_begin(self, manifest: Manifest | None, **kw: Any) -> Any:
        return begin_update(self.model, manifest, **kw)

    # ---- bookkeeping
    def fresh(self, key: VersionKey) -> Fresh:
        return FRESH.get((self.cache_tag(), key), lambda: self.build_fresh(key))

    def cache_tag(self) -> tuple:
        return (self.flavor,)

    def note(self, rule: str, **params: Any) -> None:
        self.log.append((rule, params))
        STATS[f"rule:{rule}"] += 1
        fault = params.get("fault")
        if fault:
            STATS[f"fault:{fault}"] += 1

    def items_of(self, seed: int, subset: set[str] | None = None) -> list:
        table = self.table()[seed]
        return [(n, table[n]) for n in self.names if subset is None or n in subset]

    def describe(self, key: VersionKey) -> str:
        return describe_key(key, self.names)

    def splits_a_processed_layer(self, names: set[str]) -> bool:
        """Whether ``names`` holds some but not all keys of a layer that needs processing."""
        by_layer: dict[str, set[str]] = {}
        for n in self.names:
            by_layer.setdefault(self.layer(n), set()).add(n)
        return any(0 < len(names & keys) < len(keys) for layer, keys in by_layer.items()
                   if layer in self.processed_layers)

    def expect(self, label: str, fn: Callable[[], T], error: type | tuple | None, name: str | None = None) -> Any:
        """Run ``fn``; it must succeed (``error`` None) or raise ``error`` naming ``name``."""
        try:
            out = fn()
        except Exception as e:
            if error is None:
                raise GoodUpdateRejected(f"{label}: a good update raised {type(e).__name__}: {e}") from e
            if not isinstance(e, error):
                raise WrongError(f"{label}: expected {_names(error)}, got {type(e).__name__}: {e}") from e
            if name is not None and name not in str(e) and name not in getattr(e, "missing", ()):
                raise WrongError(f"{label}: {type(e).__name__} does not name {name}: {e}") from e
            return e
        if error is not None:
            raise BadUpdateAccepted(f"{label}: expected {_names(error)}"
                                    + (f" naming {name}" if name else "") + ", but it committed")
        return out

    # ---- the checks
    def check(self) -> None:
        """The promise, after every step."""
        state = get_state(self.model)
        if self.session is not None:
            if state.active is not self.session:
                raise SessionLeft(f"the open session is not the model's active one ({state.active!r})")
            self.check_refuses_mid_update()
            return
        if state.active is not None:
            raise SessionLeft(f"no update is open, yet the model has an active session "
                              f"(version {state.active.version!r}, {state.active.status})")
        if "load_weights" in self.model.__dict__ or "_ws_saved_load_weights" in self.model.__dict__:
            raise ShimLeft("initialize_layerwise_reload's load_weights shim is still installed on the model "
                           "although no layerwise reload is in progress")
        check_pointers(self.model, self.baseline)
        reason = torn_reason(self.model)
        if reason is not None:
            if not self.world.torn_allowed:
                raise TornAfterGoodUpdate(f"torn ({reason}) although the world says it serves "
                                          f"{self.describe(self.world.expected)}")
            self.check_refuses_torn(reason)
            return
        diff = kernel_differences(self.model, self.fresh(self.world.expected).kernel)
        if diff:
            raise MixedVersionsServed(
                f"not torn, but {len(diff)} kernel tensor(s) differ from a fresh load of "
                f"{self.describe(self.world.expected)}: " + "; ".join(self.whose(n) for n in diff[:4])
            )

    def whose(self, kernel_name: str) -> str:
        """Which base versions a kernel tensor matches bitwise (diagnostics of a mix)."""
        from weight_sync.testing import bitwise_equal, kernel_tensors

        got = kernel_tensors(self.model).get(kernel_name)
        if not self.diagnose:
            return kernel_name
        if got is None:
            return f"{kernel_name} (missing)"
        hits = [f"v{s}" for s in SEEDS
                if bitwise_equal(got, self.fresh(base_key(s, self.names)).kernel.get(kernel_name, got[:0]))]
        return f"{kernel_name} holds {'/'.join(hits) or 'bytes of no version'}"

    def check_refuses_mid_update(self) -> None:
        pass

    def check_refuses_torn(self, reason: str) -> None:
        pass

    def final_check(self) -> None:
        """End of a sequence: close what is open, the next good full update succeeds, nothing leaked."""
        if self.session is not None:
            self.abort_open()
        self.check()
        seed = 1 if self.world.expected != base_key(1, self.names) else 2
        items = self.items_of(seed)
        self.note("final_full_update", seed=seed)
        self.expect("the next good full update", lambda: self.do_reload(weights_iterator=iter(items)), None)
        self.world.committed_full(base_key(seed, self.names))
        self.check()

    def check_hygiene(self) -> None:
        self.hygiene.check(f"{type(self).__name__}({self.flavor})")

    # ---- world updates
    def commit(self, seed: int, names: set[str]) -> None:
        if names >= set(self.names):
            self.world.committed_full(base_key(seed, self.names))
        else:
            self.world.committed_partial(merged_key(self.world.expected, self.names, names, seed))

    # ---------------------------------------------------------------------------- rules
    def full_update(self, draw: Draw) -> None:
        """A good full update through an iterator or the transaction API (any order, any chunks)."""
        route = draw.choice("route", self.routes())
        seed = draw.choice("version", SEEDS)
        rollback = draw.choice("rollback", (False, True))
        self.note("full_update", route=route, seed=seed, rollback=rollback)
        if route == "path":
            path = assets(self.arch).paths[seed]
            self.expect("full update from a path",
                        lambda: self.do_reload(weights_path=path, rollback=rollback), None)
        else:
            items = _wire(draw, _reorder(draw, self.items_of(seed)))
            manifest = manifest_of(items) if draw.choice("manifest", (False, True)) else None
            self._stream_update(draw, route, items, manifest, rollback=rollback, allow_partial=False,
                                fault=None, error=None, label=f"full update to v{seed} ({route})")
        self.world.committed_full(base_key(seed, self.names))

    def partial_update(self, draw: Draw) -> None:
        """allow_partial=True with a subset of whole layers (or, ``split``, half of a fused layer)."""
        route = draw.choice("route", ("iterator", "transaction"))
        seed = draw.choice("version", SEEDS)
        rollback = draw.choice("rollback", (False, True))
        layers = sorted({self.layer(n) for n in self.names})
        picked = set(draw.subset("layers", layers))
        names = {n for n in self.names if self.layer(n) in picked}
        split = False
        if draw.choice("split", (False, True)):
            fused = [n for n in sorted(names) if sum(self.layer(m) == self.layer(n) for m in names) > 1]
            if fused:
                names.discard(draw.choice("dropped", fused))
                split = True
        with_manifest = draw.choice("manifest", (False, True))
        self.note("partial_update", route=route, seed=seed, rollback=rollback, layers=sorted(picked),
                  split=split, manifest=with_manifest, fault="split_processed_layer" if split else None)
        items = _wire(draw, _reorder(draw, self.items_of(seed, names)))
        manifest = manifest_of(items) if with_manifest else None
        error = None
        if self.splits_a_processed_layer(names):
            error = ManifestError if with_manifest else IncompleteUpdateError
        ok = self._stream_update(draw, route, items, manifest, rollback=rollback, allow_partial=True,
                                 fault=None, error=error, label=f"partial update to v{seed} ({route})",
                                 fails_at_begin=error is ManifestError)
        if ok:
            self.commit(seed, names)

    def faulty_update(self, draw: Draw) -> None:
        """A full update with one fault: wrong shape or dtype, unknown, duplicate or missing name, a
        source raising after k tensors, a caller raising inside the session, or an explicit abort()."""
        route = draw.choice("route", self.routes())
        seed = draw.choice("version", SEEDS)
        rollback = draw.choice("rollback", (False, True))
        if route == "path":
            kind = draw.choice("fault", ("shape", "dtype", "unknown", "missing"))
            self.note("faulty_update", route=route, fault=kind, rollback=rollback)
            path = assets(self.arch).faulty_paths[kind]
            self.expect(f"update from a checkpoint whose headers hold a {kind} fault",
                        lambda: self.do_reload(weights_path=path, rollback=rollback), ManifestError)
            return  # headers are validated before any write: nothing changed
        extra = ("source_raises",) if route == "iterator" else ("caller_raises", "abort")
        kind = draw.choice("fault", FAULTS + extra)
        items = _wire(draw, _reorder(draw, self.items_of(seed)))
        with_manifest = draw.choice("manifest", (False, True))
        self.note("faulty_update", route=route, seed=seed, fault=kind, rollback=rollback,
                  manifest=with_manifest)
        label = f"update to v{seed} with a {kind} fault ({route})"
        if kind in FAULTS:
            items, fault = inject(draw, items, kind, self.unknown_names)
            manifest = manifest_of(items) if with_manifest else None
            announced = with_manifest and kind != "duplicate"
            error = ManifestError if announced else NO_MANIFEST_ERRORS[kind]
            self._stream_update(draw, route, items, manifest, rollback=rollback, allow_partial=False,
                                fault=fault, error=error, label=label, fails_at_begin=announced)
            return
        manifest = manifest_of(items) if with_manifest else None
        after = draw.integer("after", 0, len(items) - 1)
        if kind == "source_raises":
            self.expect(label, lambda: self.do_reload(weights_iterator=failing_source(items, after),
                                                      manifest=manifest, rollback=rollback),
                        SourceError, name=items[after - 1][0] if after else None)
        else:
            def run() -> None:
                session = self.do_begin(manifest, rollback=rollback)
                with session:
                    session.load(list(items[:after]))
                    if kind == "abort":
                        session.abort()
                    else:
                        raise InjectedFailure("the caller crashed inside the session")
                if session.status != "aborted":
                    raise BadUpdateAccepted(f"{label}: the session ended {session.status!r}, not aborted")

            self.expect(label, run, None if kind == "abort" else InjectedFailure)
        self.world.failed(rollback=rollback, before_any_write=after == 0)

    def _stream_update(self, draw: Draw, route: str, items: list, manifest: Manifest | None, *,
                       rollback: bool, allow_partial: bool, fault: Fault | None, error: type | None,
                       label: str, fails_at_begin: bool = False) -> bool:
        """Run one update of ``items``; True when it committed. On an expected failure the world is told."""
        name = fault.name if fault is not None else None
        if route == "iterator":
            self.expect(label, lambda: self.do_reload(weights_iterator=iter(items), manifest=manifest,
                                                      rollback=rollback, allow_partial=allow_partial),
                        error, name)
        else:
            calls = [as_call_arg(draw, c) for c in chunks(draw, items)]

            def run() -> None:
                with self.do_begin(manifest, rollback=rollback, allow_partial=allow_partial) as s:
                    for c in calls:
                        s.load(c)

            self.expect(label, run, error, name)
        if error is None:
            return True
        first_bad = fault.index if fault is not None and fault.index is not None else len(items)
        self.world.failed(rollback=rollback, before_any_write=fails_at_begin or first_bad == 0)
        return False

    # ---- an update session left open across steps
    def begin(self, draw: Draw) -> None:
        """Open a session (the transaction API); later steps load, serve, finish, abort or crash."""
        seed = draw.choice("version", SEEDS)
        rollback = draw.choice("rollback", (False, True))
        kind = draw.choice("fault", (None, *FAULTS))
        with_manifest = draw.choice("manifest", (False, True))
        self.note("begin", seed=seed, rollback=rollback, fault=kind, manifest=with_manifest)
        items = _wire(draw, _reorder(draw, self.items_of(seed)))
        fault = None
        if kind is not None:
            items, fault = inject(draw, items, kind, self.unknown_names)
        manifest = manifest_of(items) if with_manifest else None
        if with_manifest and kind not in (None, "duplicate"):
            self.expect(f"begin v{seed} with a manifest announcing a {kind} fault",
                        lambda: self.do_begin(manifest, rollback=rollback), ManifestError)
            return
        self.session = self.expect(f"begin v{seed}", lambda: self.do_begin(manifest, rollback=rollback), None)
        self.open = {"seed": seed, "rollback": rollback, "fault": fault, "pending": items, "all": items,
                     "loaded": 0}

    def load_next(self, draw: Draw) -> None:
        pending = self.open["pending"]
        n = draw.integer("num_tensors", 1, len(pending))
        chunk, self.open["pending"] = pending[:n], pending[n:]
        fault = self.open["fault"]
        start = self.open["loaded"]
        self.note("load_next", num_tensors=n)
        hits = fault is not None and fault.index is not None and start <= fault.index < start + n
        s = self.session
        self.expect(f"load of {n} tensor(s)", lambda: s.load(as_call_arg(draw, chunk)),
                    NO_MANIFEST_ERRORS[fault.kind] if hits else None, fault.name if hits else None)
        self.open["loaded"] += n
        if hits:
            self._closed_by_failure(before_any_write=fault.index == 0)

    def finish(self, draw: Draw) -> None:
        s, fault = self.session, self.open["fault"]
        left = self.open["pending"]
        self.note("finish", left=len(left))
        # Expected tensors never loaded (an injected unknown name or a second copy left pending is none).
        arrived = {n for n, _ in self.open["all"][:self.open["loaded"]]}
        missing = [n for n, _ in left if n in self.names and n not in arrived]
        if fault is not None and fault.kind == "missing":
            missing.insert(0, fault.name)
        incomplete = bool(missing)
        name = missing[0] if missing else None
        self.expect("finish", s.finish, IncompleteUpdateError if incomplete else None, name)
        if incomplete:
            self._closed_by_failure(before_any_write=self.open["loaded"] == 0)
        else:
            self.session = None
            self.world.committed_full(base_key(self.open["seed"], self.names))
            self.open = {}

    def abort_open(self, draw: Draw | None = None) -> None:
        self.note("abort")
        self.session.abort()
        if self.session.status != "aborted":
            raise BadUpdateAccepted(f"abort() left the session {self.session.status!r}")
        self._closed_by_failure(before_any_write=self.open["loaded"] == 0)

    def caller_raises(self, draw: Draw) -> None:
        """The caller's code raises inside ``with session:`` (what __exit__ sees)."""
        self.note("caller_raises")
        s = self.session
        s.__exit__(InjectedFailure, InjectedFailure("the caller crashed"), None)
        if s.status != "aborted":
            raise BadUpdateAccepted(f"an exception inside the session left it {s.status!r}")
        self._closed_by_failure(before_any_write=self.open["loaded"] == 0)

    def _closed_by_failure(self, *, before_any_write: bool) -> None:
        self.world.failed(rollback=self.open["rollback"], before_any_write=before_any_write)
        self.session, self.open = None, {}

    # ---- the seed's aliases
    def seed_alias_update(self, draw: Draw) -> None:
        """initialize_layerwise_reload; model.load_weights(...) in 1-3 calls; finalize_layerwise_processing.
        A fault makes one load_weights call raise; then the session must be over, the shim gone."""
        seed = draw.choice("version", SEEDS)
        rollback = draw.choice("rollback", (False, True))
        kind = draw.choice("fault", (None, "shape", "unknown", "duplicate", "missing", "source_raises"))
        self.note("seed_alias_update", seed=seed, rollback=rollback, fault=kind)
        items = _reorder(draw, self.items_of(seed))
        fault = None
        if kind in FAULTS:
            items, fault = inject(draw, items, kind, self.unknown_names)
        elif kind == "source_raises":
            fault = Fault(kind, draw.integer("after", 0, len(items) - 1), "")
        calls = chunks(draw, items)
        expect_load = {"shape": LayoutMismatchError, "unknown": UnknownTensorError,
                       "duplicate": DuplicateTensorError, "source_raises": InjectedFailure}
        self.expect("initialize_layerwise_reload",
                    lambda: initialize_layerwise_reload(self.model, rollback=rollback), None)
        done = 0
        for c in calls:
            hits = fault is not None and fault.index is not None and done <= fault.index < done + len(c)
            if hits and kind == "source_raises":
                arg: Any = failing_source(c, fault.index - done)
            else:
                arg = list(c)
            self.expect("model.load_weights", lambda a=arg: self.model.load_weights(a),
                        expect_load[kind] if hits else None, fault.name if hits and fault.name else None)
            done += len(c)
            if hits:
                # The session is over; finalize has nothing to commit and must say so, not commit.
                self.expect("finalize_layerwise_processing after a failed load_weights",
                            lambda: finalize_layerwise_processing(self.model), WeightSyncError)
                self.world.failed(rollback=rollback, before_any_write=fault.index == 0)
                return
        if kind == "missing":
            self.expect("finalize_layerwise_processing of an incomplete update",
                        lambda: finalize_layerwise_processing(self.model), IncompleteUpdateError, fault.name)
            self.world.failed(rollback=rollback, before_any_write=False)
            return
        self.expect("finalize_layerwise_processing", lambda: finalize_layerwise_processing(self.model), None)
        self.world.committed_full(base_key(seed, self.names))

    def routes(self) -> tuple[str, ...]:
        return ("iterator", "transaction")


def _names(error: type | tuple) -> str:
    if isinstance(error, tuple):
        return " or ".join(e.__name__ for e in error)
    return error.__name__


# ---------------------------------------------------------------------------------------- engine
ENGINE_FLAVORS: dict[str, dict[str, Any]] = {
    "fp8": {"quantization": "fp8"},
    "bf16": {},
    "fp32": {"dtype": torch.float32},
    "fp8_block": {"quantization": "fp8_block"},
}
# One prompt of a few tokens: a static KV cache of the default size (8 x 512) would cost more than the
# whole reload lifecycle.
ENGINE_SIZE = {"max_batch_size": 1, "max_seq_len": 8}


class EngineDriver(Driver):
    """A :class:`ReferenceEngine` of dense Qwen3 or Qwen3-MoE (TP=1 in process, or one rank of a TP group)."""

    serves = True

    def __init__(self, flavor: str, tp_group: Any = None, arch: str = "qwen3") -> None:
        from weight_sync.engine import ReferenceEngine

        self.flavor = flavor
        self.tp_group = tp_group
        self.arch = arch
        if arch == "qwen3_moe":
            self.unknown_names = MOE_UNKNOWN_NAMES
        self._cls = ReferenceEngine
        # The checkpoints exist before the hygiene baseline (Driver.__init__): the first make_checkpoint
        # of a process creates a tqdm bar (disabled, yet tqdm starts its process-lifetime monitor thread
        # in __new__), which a baseline taken before would count as the first sequence's leak.
        a = assets(arch)
        if "quantization" in ENGINE_FLAVORS[flavor]:  # quantized linears and experts: processed layers
            self.processed_layers = frozenset({layer_of(n) for n in a.names if n.endswith("_proj.weight")})
        super().__init__()

    def build_model(self) -> nn.Module:
        self.engine = self._cls.from_checkpoint(assets(self.arch).paths[0], tp_group=self.tp_group,
                                                **ENGINE_FLAVORS[self.flavor], **ENGINE_SIZE)
        return self.engine.model

    def version_names(self) -> tuple[str, ...]:
        return assets(self.arch).names

    def table(self):
        return assets(self.arch).items

    def layer(self, name: str) -> str:
        return layer_of(name)

    def routes(self) -> tuple[str, ...]:
        return ("iterator", "transaction", "path")

    def cache_tag(self) -> tuple:
        import torch.distributed as dist

        tp = (dist.get_rank(self.tp_group), dist.get_world_size(self.tp_group)) if self.tp_group else (0, 1)
        return (self.arch, self.flavor, *tp)

    def build_fresh(self, key: VersionKey) -> Fresh:
        a = assets(self.arch)
        seeds = set(key)
        opts = dict(tp_group=self.tp_group, **ENGINE_FLAVORS[self.flavor], **ENGINE_SIZE)
        if len(seeds) == 1:
            fresh = self._cls.from_checkpoint(a.paths[seeds.pop()], **opts)
        else:
            fresh = self._cls.from_config(a.cfg, weights=version_items(key, self.names, a.items), **opts)
        return Fresh(snapshot_kernel(fresh.model), fresh.logits(PROMPT), fresh.generate(GEN_PROMPT, GEN_TOKENS))

    def do_reload(self, **kw: Any) -> Any:
        return self.engine.reload_weights(**kw)

    def do_begin(self, manifest: Manifest | None, **kw: Any) -> Any:
        return self.engine.begin_update(manifest, **kw)

    def serve(self, draw: Draw) -> None:
        """generate or logits: refuses (naming the failure) when torn or mid-update, else equals fresh."""
        call = draw.choice("call", ("logits", "generate"))
        self.note("serve", call=call, open=self.session is not None)
        fn = (lambda: self.engine.logits(PROMPT)) if call == "logits" else (
            lambda: self.engine.generate(GEN_PROMPT, GEN_TOKENS))
        if self.session is not None:
            self._refuses(fn, f"{call} while update {self.session.version!r} is open",
                          (UpdateStateError, TornModelError), ServedDuringOpenUpdate)
            return
        reason = torn_reason(self.model)
        if reason is not None:
            self._refuses(fn, f"{call} on a torn engine", TornModelError, RefusalWithoutReason)
            return
        out = fn()
        fresh = self.fresh(self.world.expected)
        want = fresh.logits if call == "logits" else fresh.tokens
        same = torch.equal(out, want) if call == "logits" else out == want
        if not same:
            raise ServingMismatch(f"{call} differs from a fresh engine of {self.describe(self.world.expected)}")

    def _refuses(self, fn: Callable[[], Any], label: str, errors: Any, violation: type) -> None:
        try:
            fn()
        except errors as e:
            if "update" not in str(e):
                raise RefusalWithoutReason(f"{label}: refused without naming the update: {e}") from e
            return
        raise violation(f"{label}: it served")

    def check_refuses_mid_update(self) -> None:
        self._refuses(lambda: self.engine.logits(PROMPT),
                      f"logits while update {self.session.version!r} is open",
                      (UpdateStateError, TornModelError), ServedDuringOpenUpdate)

    def check_refuses_torn(self, reason: str) -> None:
        self._refuses(lambda: self.engine.logits(PROMPT), "logits on a torn engine", TornModelError,
                      RefusalWithoutReason)


# ---------------------------------------------------------------------------------------- plain module
class Doubled(nn.Module):
    """A layer with processing: its kernel weight is twice the loaded one, plus a derived row sum."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 6), requires_grad=False)

    def process_weights_after_loading(self) -> None:
        w = self.weight.detach() * 2
        self.weight = nn.Parameter(w.contiguous(), requires_grad=False)
        self.row_sum = w.sum(1)  # a tensor attribute a kernel would read


class PlainNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.proc = Doubled()
        self.register_buffer("scale", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = lin(x) * self.scale
        return x @ self.proc.weight.t()


_PLAIN_TABLE: dict[int, dict[str, torch.Tensor]] = {}


def plain_table() -> dict[int, dict[str, torch.Tensor]]:
    if not _PLAIN_TABLE:
        shapes = {n: t.shape for n, t in PlainNet().state_dict().items()}
        for s in SEEDS:
            g = torch.Generator().manual_seed(100 + s)
            _PLAIN_TABLE[s] = {n: torch.randn(shape, generator=g) for n, shape in shapes.items()}
    return _PLAIN_TABLE


class PlainDriver(Driver):
    """A plain ``nn.Module`` (no load_weights): record_metadata_for_reloading + begin_update."""

    flavor = "plain"
    processed_layers = frozenset({"proc"})

    def build_model(self) -> nn.Module:
        model = PlainNet()
        record_metadata_for_reloading(model)
        reload_weights(model, weights_iterator=iter(self.items_of_table(0)), version="initial")
        return model

    def items_of_table(self, seed: int) -> list:
        return list(plain_table()[seed].items())

    def version_names(self) -> tuple[str, ...]:
        return tuple(plain_table()[0])

    def table(self):
        return plain_table()

    def layer(self, name: str) -> str:
        return name.rpartition(".")[0]

    def build_fresh(self, key: VersionKey) -> Fresh:
        model = PlainNet()
        record_metadata_for_reloading(model)
        reload_weights(model, weights_iterator=iter(version_items(key, self.names, plain_table())))
        return Fresh(snapshot_kernel(model))
