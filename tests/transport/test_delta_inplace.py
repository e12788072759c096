"""A delta applied in place (no transport: the engine's DeltaSession fed encodings directly) leaves every
kernel tensor bitwise equal to a full reload of the same weights, and its fingerprint, computed from
checksums moved by the changes, equals one read from the tensors; an abort with rollback restores
exactly the written elements."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine runs GPU tests without it
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.layers.tensors import iter_graph_visible_tensors
from weight_sync.manifest import Manifest
from weight_sync.quant import QUANTIZATION_NAMES
from weight_sync.reload.api import begin_update
from weight_sync.reload.state import get_state
from weight_sync.transport.delta import encode_delta
from weight_sync.transport.delta_sync import DeltaSession, ReceiverDeltaBase

# Every test here runs with the native CPU kernels and with their numpy twins (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_delta_kernels")
PATTERNS = ["empty", "one", "block", "dense", "all", "random"]
QUANTIZATIONS = [None, *sorted(QUANTIZATION_NAMES)]
_PAIRS: dict[Any, dict[str, Any]] = {}


def _changed(t: torch.Tensor, pattern: str, g: torch.Generator) -> torch.Tensor:
    t = t.clone()
    flat = t.view(-1)
    if pattern == "one":
        flat[int(torch.randint(flat.numel(), (1,), generator=g))] += 0.5
    elif pattern == "block" and t.dim() == 2:
        r, c = (int(torch.randint(n, (1,), generator=g)) for n in t.shape)
        t[r : r + 128, c : c + 128] += 0.01
    elif pattern in ("dense", "all", "random"):
        p = {"dense": 0.9, "all": 1.0, "random": 0.02}[pattern]
        mask = torch.rand(t.shape, generator=g) < p
        t[mask] += (torch.randn(t.shape, generator=g) * 0.05 + 1e-2).to(t.dtype)[mask]
    return t


def _pair(ckpt: Path, quantization: Any) -> dict[str, Any]:
    """Two engines of one checkpoint, kept across examples: one takes deltas, one full reloads."""
    if quantization not in _PAIRS:
        spec = None if quantization is None else QUANTIZATION_NAMES[quantization]
        weights = {n: t.to(torch.bfloat16) for n, t in CheckpointSource(ckpt)}
        pair = {"delta": ReferenceEngine.from_checkpoint(ckpt, quantization=spec),
                "full": ReferenceEngine.from_checkpoint(ckpt, quantization=spec),
                "base": ReceiverDeltaBase(), "weights": weights, "version": 1}
        first = DeltaSession(_session(pair["delta"], weights, 1), pair["base"], "full")  # records the base
        first.load(list(weights.items()))
        first.finish()
        _PAIRS[quantization] = pair
    return _PAIRS[quantization]


def _session(engine: ReferenceEngine, weights: dict[str, torch.Tensor], version: int, rollback: bool = False) -> Any:
    return begin_update(engine.model, Manifest.from_named_tensors(weights.items(), version=version),
                        version=version, rollback=rollback)


def _delta_and_full(pair: dict[str, Any], new: dict[str, torch.Tensor], chunk_elems: int = 1024) -> Any:
    """The next version ``new`` as a delta (chunks of ``chunk_elems``) into the pair's delta engine and in
    full into the other; the delta's report."""
    old = pair["weights"]
    pair["version"] += 1
    v = pair["version"]
    session = DeltaSession(_session(pair["delta"], new, v), pair["base"], "delta")
    session.load([(n, encode_delta(new[n], old[n], chunk_elems=chunk_elems)) for n in old])
    report = session.finish()
    full = _session(pair["full"], new, v)
    full.load(list(new.items()))
    full.finish()
    pair["weights"] = new
    return report


def _tensors(engine: ReferenceEngine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in iter_graph_visible_tensors(engine.model) if t.device.type != "meta"}


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(torch.uint8) if a[n].dtype.itemsize == 1 else a[n], b[n].view(torch.uint8)
                    if b[n].dtype.itemsize == 1 else b[n]) for n in a
    )


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(quantization=st.sampled_from(QUANTIZATIONS), pattern=st.sampled_from(PATTERNS),
       which=st.sampled_from(["every tensor", "one tensor"]), seed=st.integers(0, 2**16))
def test_a_delta_applied_in_place_equals_a_full_reload_bit_for_bit(
    qwen3_a: Path, quantization: Any, pattern: str, which: str, seed: int
) -> None:
    pair = _pair(qwen3_a, quantization)
    g = torch.Generator().manual_seed(seed)
    old = pair["weights"]
    names = list(old)
    pick = {names[seed % len(names)]} if which == "one tensor" else set(names)
    new = {n: _changed(t, pattern, g) if n in pick else t for n, t in old.items()}
    report = _delta_and_full(pair, new)

    assert pair["base"].last_stats["in_place"] == len(names)  # no key rebuilt and loaded whole
    assert _bits_equal(_tensors(pair["delta"]), _tensors(pair["full"]))
    assert report.fingerprint == pair["delta"].fingerprint() == pair["full"].fingerprint()


@pytest.mark.parametrize("quantization", [None, "fp8_block", "fp8"])
def test_an_aborted_delta_with_rollback_restores_exactly_the_engine_it_started_from(
    qwen3_a: Path, quantization: Any
) -> None:
    pair = _pair(qwen3_a, quantization)
    old = pair["weights"]
    g = torch.Generator().manual_seed(7)
    new = {n: _changed(t, "random", g) for n, t in old.items()}
    before = _tensors(pair["delta"])
    pair["version"] += 1
    session = DeltaSession(_session(pair["delta"], new, pair["version"], rollback=True), pair["base"], "delta")
    names = list(old)
    session.load([(n, encode_delta(new[n], old[n], chunk_elems=1024)) for n in names[: len(names) // 2]])
    session.abort("the trainer went away")
    assert _bits_equal(_tensors(pair["delta"]), before)
    # The base went with the abort: the next update must be full (a delta would be refused).
    assert not pair["base"].valid
    _PAIRS.pop(quantization)


def test_an_aborted_delta_without_rollback_leaves_the_engine_torn_until_a_full_update(qwen3_a: Path) -> None:
    from weight_sync.reload import torn_reason

    pair = _pair(qwen3_a, "fp8_block")
    old = pair["weights"]
    new = {n: _changed(t, "random", torch.Generator().manual_seed(9)) for n, t in old.items()}
    pair["version"] += 1
    session = DeltaSession(_session(pair["delta"], new, pair["version"]), pair["base"], "delta")
    names = list(old)
    session.load([(n, encode_delta(new[n], old[n], chunk_elems=1024)) for n in names[:3]])
    session.abort("the trainer went away")
    assert torn_reason(pair["delta"].model) is not None
    pair["version"] += 1
    full = DeltaSession(_session(pair["delta"], new, pair["version"]), pair["base"], "full")
    full.load(list(new.items()))
    full.finish()
    assert torn_reason(pair["delta"].model) is None
    _PAIRS.pop("fp8_block")


def test_deltas_reuse_their_routes_until_a_key_is_planned_again_or_a_tensor_moves(qwen3_a: Path) -> None:
    # Routing every key costs a walk of the plan per update (hundreds of keys): deltas keep the last
    # delta's routes, but never across a re-planned key or a moved tensor (a layout may have changed).
    pair = _pair(qwen3_a, "fp8_block")
    weights, applier = pair["weights"], pair["base"].applier

    def delta() -> Any:
        pair["version"] += 1
        session = DeltaSession(_session(pair["delta"], weights, pair["version"]), pair["base"], "delta")
        session.load([(n, encode_delta(t, t)) for n, t in weights.items()])  # nothing changed
        session.finish()
        return applier._routes

    first = delta()
    assert first is not None and delta() is first
    state = get_state(pair["delta"].model)
    name = next(iter(weights))
    state.plan.add(state.plan.keys[name])  # planned again (same plan): routes made again
    replanned = delta()
    assert replanned is not first and replanned[1] == first[1]
    norm = pair["delta"].model.model.norm
    norm.weight.data = norm.weight.data.clone()  # same values, another address
    assert delta() is not replanned
    assert pair["base"].last_stats["in_place"] == len(weights)


def test_the_first_delta_after_a_full_update_reuses_its_routes_unless_the_update_changed_what_they_derive_from(
        qwen3_a: Path) -> None:
    # The full update routes every key to record the model-format copies; the delta after it would route
    # them all again (a fallback, or a bench alternating both) unless they are kept at its commit.
    pair = _pair(qwen3_a, "fp8_block")
    weights, applier = pair["weights"], pair["base"].applier
    state = get_state(pair["delta"].model)

    def update(mode: str, during: Any = None) -> Any:
        pair["version"] += 1
        session = DeltaSession(_session(pair["delta"], weights, pair["version"]), pair["base"], mode)
        session.load(list(weights.items()) if mode == "full" else [(n, encode_delta(t, t)) for n, t in weights.items()])
        if during is not None:
            during()
        session.finish()
        return applier._routes

    kept = update("full")
    assert kept is not None and update("delta") is kept
    assert pair["base"].last_stats["in_place"] == len(weights)
    name = next(iter(weights))
    # A key planned again while the full update ran: its routes may be stale, so none are kept.
    assert update("full", during=lambda: state.plan.add(state.plan.keys[name])) is None
    again = update("delta")
    assert again is not None and again is not kept and again[1] == kept[1]


@pytest.mark.parametrize("quantization", [None, "fp8_block"])
def test_a_delta_writes_into_the_storage_a_tensor_has_now_not_the_one_an_earlier_delta_wrote(
        qwen3_a: Path, quantization: Any) -> None:
    # The applier keeps each target's views across deltas (host time): a parameter whose storage was
    # swapped in between (same values, another address) must get the next delta's writes.
    pair = _pair(qwen3_a, quantization)

    def delta(seed: int) -> None:
        old = pair["weights"]
        new = {n: _changed(t, "random", torch.Generator().manual_seed(seed)) for n, t in old.items()}
        pair["version"] += 1
        session = DeltaSession(_session(pair["delta"], new, pair["version"]), pair["base"], "delta")
        session.load([(n, encode_delta(new[n], old[n], chunk_elems=1024)) for n in new])
        report = session.finish()
        full = _session(pair["full"], new, pair["version"])
        full.load(list(new.items()))
        full.finish()
        pair["weights"] = new
        assert _bits_equal(_tensors(pair["delta"]), _tensors(pair["full"]))
        assert report.fingerprint == pair["full"].fingerprint()

    delta(11)
    model = pair["delta"].model
    layer = model.model.layers[0]
    for p in (model.model.norm.weight, layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
        p.data = p.data.clone()  # same values, another address
    delta(12)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_a_host_scatter_failing_among_threaded_ones_is_raised_and_rollback_undoes_every_other_write(
    qwen3_a: Path, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Host scatters of one bucket run on several threads: one that fails writes nothing, and every one
    # that wrote is recorded before the error is raised, so the rollback restores the whole engine.
    from weight_sync import native

    if not native.enabled():
        pytest.skip("the numpy twin scatters one tensor at a time, without the threads")
    monkeypatch.setenv("WEIGHT_SYNC_NATIVE_THREADS", threads)
    monkeypatch.setattr(native, "PARALLEL_MIN_BYTES", 0)  # threads for this small model too
    pair = _pair(qwen3_a, None)
    old = pair["weights"]
    new = {n: _changed(t, "random", torch.Generator().manual_seed(11)) for n, t in old.items()}
    before = _tensors(pair["delta"])
    real, calls = native.scatter_tensors, []

    def scatter(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("scatter number 3 failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(native, "scatter_tensors", scatter)
    pair["version"] += 1
    session = DeltaSession(_session(pair["delta"], new, pair["version"], rollback=True), pair["base"], "delta")
    with pytest.raises(RuntimeError, match="scatter number 3"):
        session.load([(n, encode_delta(new[n], old[n], chunk_elems=1024)) for n in old])
        session.finish()
    assert len(calls) > 3  # the others ran (and wrote) before the failure was raised
    session.abort("a scatter failed")
    assert _bits_equal(_tensors(pair["delta"]), before)
    _PAIRS.pop(None)


# 1 Ki chunks: tables beyond the leading bytes a bucket reads together, each payload parsed alone; 64 Ki
# (the default): tables read together, the batch taking them as arrays.
@pytest.mark.parametrize("chunk_elems", [1024, 1 << 16])
def test_index_only_payloads_without_rollback_are_written_from_their_offsets_and_equal_a_full_reload(
    qwen3_a: Path, chunk_elems: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without rollback nothing keeps positions or old values: a host payload of index chunks into one
    # whole live tensor is written straight from its 16-bit offsets (no positions made).
    from weight_sync import native

    if not native.enabled():
        pytest.skip("the numpy twin decodes every payload")
    pair = _pair(qwen3_a, None)
    old = pair["weights"]
    new = {n: _changed(t, "random", torch.Generator().manual_seed(13)) for n, t in old.items()}
    # Spied: both ways an encoding joins the batch (a table read with its bucket's, or one parsed alone).
    real, real_table, fused = native.OffsetBatch.add, native.OffsetBatch.add_table, []
    monkeypatch.setattr(native.OffsetBatch, "add", lambda self, *a: fused.append(a[0]) or real(self, *a))
    monkeypatch.setattr(native.OffsetBatch, "add_table",
                        lambda self, *a: fused.extend(a[0]) or real_table(self, *a))
    report = _delta_and_full(pair, new, chunk_elems)
    assert len(fused) >= len(old) // 2  # the direct layers' keys (others are norms in fp32, converted)
    assert _bits_equal(_tensors(pair["delta"]), _tensors(pair["full"]))
    assert report.fingerprint == pair["full"].fingerprint()


@pytest.mark.parametrize("chunk_elems", [1024, 1 << 16])
def test_a_damaged_index_only_payload_is_refused_before_any_payload_of_its_bucket_is_written(
    qwen3_a: Path, chunk_elems: int
) -> None:
    from weight_sync.errors import LayoutMismatchError
    from weight_sync.transport.delta import _parse

    pair = _pair(qwen3_a, None)
    old = pair["weights"]
    new = {n: _changed(t, "random", torch.Generator().manual_seed(17)) for n, t in old.items()}
    names = list(old)
    payloads = [(n, encode_delta(new[n], old[n], chunk_elems=chunk_elems)) for n in names]
    # The last matrix's payload damaged (every payload before it would be written if checks and writes
    # went payload by payload): its first two index offsets made equal, its sizes all still agreeing.
    at = max(i for i, n in enumerate(names) if new[n].dim() == 2)
    bad = payloads[at][1].clone()
    offsets = _parse(bad, new[names[at]].numel(), new[names[at]].dtype).regions[1].view(torch.int16)
    offsets[1] = offsets[0]
    payloads[at] = (names[at], bad)
    before = _tensors(pair["delta"])
    pair["version"] += 1
    session = DeltaSession(_session(pair["delta"], new, pair["version"]), pair["base"], "delta")
    with pytest.raises(LayoutMismatchError, match="repeat or are out of order"):
        session.load(payloads)
        session.finish()
    assert _bits_equal(_tensors(pair["delta"]), before), "nothing is written before every payload is checked"
    session.abort("a damaged payload")
    _PAIRS.pop(None)
