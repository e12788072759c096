"""Dense deltas into block- and channel-scaled fp8 weights are written into the model-format copies and
requantized whole, grouped per bucket (the CUDA default): bitwise the same engine as the tile / row path
and as a full reload, also when the keys of one fused weight take different paths."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

import weight_sync.reload.delta_apply as delta_apply
from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.layers.tensors import iter_graph_visible_tensors
from weight_sync.manifest import Manifest
from weight_sync.quant import QUANTIZATION_NAMES
from weight_sync.reload.api import begin_update
from weight_sync.transport.delta import encode_delta
from weight_sync.transport.delta_sync import DeltaSession, ReceiverDeltaBase


def _session(engine: ReferenceEngine, weights: dict[str, torch.Tensor], version: int) -> Any:
    return begin_update(engine.model, Manifest.from_named_tensors(weights.items(), version=version), version=version)


def _state(engine: ReferenceEngine) -> dict[str, torch.Tensor]:
    """Every tensor's bytes (fp8 has no equality kernels: compared as uint8)."""
    return {n: (t.detach().view(torch.uint8) if t.dtype.itemsize == 1 else t.detach()).cpu().clone()
            for n, t in iter_graph_visible_tensors(engine.model) if t.device.type != "meta"}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _change(weights: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Each tensor changed differently: dense random (2%), one element, or not at all, by name order."""
    g = torch.Generator().manual_seed(step)
    out = {}
    for i, (n, t) in enumerate(weights.items()):
        t = t.clone()
        kind = (i + step) % 3
        if kind == 0:
            mask = torch.rand(t.shape, generator=g) < 0.02
            t[mask] = (t.float() * 1.1 + 1e-2).to(t.dtype)[mask]
        elif kind == 1:
            t.view(-1)[int(torch.randint(t.numel(), (1,), generator=g))] += 0.5
        out[n] = t
    return out


def run_deltas(ckpt: Path, quantization: str | None, device: torch.device, base_where: str, steps: int) -> int:
    """``steps`` deltas into one engine and full reloads into another (unquantized for None); asserts
    they stay bitwise equal (tensors and fingerprints) and returns how many weights took the
    whole-requantization path."""
    spec = QUANTIZATION_NAMES[quantization] if quantization else None
    delta = ReferenceEngine.from_checkpoint(ckpt, quantization=spec, device=device)
    full = ReferenceEngine.from_checkpoint(ckpt, quantization=spec, device=device)
    delta_apply.keep_delta_base(delta.model, base_where)
    base = ReceiverDeltaBase()
    old = {n: t.to(device, torch.bfloat16) for n, t in CheckpointSource(ckpt)}
    first = DeltaSession(_session(delta, old, 1), base, "full")
    first.load(list(old.items()))
    first.finish()
    whole = 0
    for step in range(2, 2 + steps):
        new = {n: t.to(device) for n, t in _change({n: t.cpu() for n, t in old.items()}, step).items()}
        session = DeltaSession(_session(delta, new, step), base, "delta")
        session.load([(n, encode_delta(new[n], old[n])) for n in new])
        report = session.finish()
        reload = _session(full, new, step)
        reload.load(list(new.items()))
        reload.finish()
        assert base.last_stats["in_place"] == len(new)
        assert _equal(_state(delta), _state(full)), f"step {step}: the delta engine differs from a full reload"
        assert report.fingerprint == delta.fingerprint() == full.fingerprint()
        whole += base.last_stats.get("requantized_whole", 0)
        old = new
    return whole


@pytest.mark.parametrize("quantization", ["fp8_block", "fp8_per_channel"])
@pytest.mark.parametrize("policy", ["always", "alternating"])
def test_weights_requantized_whole_after_the_bucket_equal_a_full_reload(
    qwen3_a: Path, quantization: str, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The CUDA rule, taken on CPU too: every weight with a change (always), or every other weight
    # (alternating: the keys of a fused qkv / gate_up then meet both paths within one update).
    turns = itertools.cycle([True, False])

    def rule(d: Any, num_changes: int) -> bool:
        return num_changes > 0 and (policy == "always" or next(turns))

    monkeypatch.setattr(delta_apply, "_requantize_whole", rule)
    assert run_deltas(qwen3_a, quantization, torch.device("cpu"), "pinned", steps=3) > 0


def abort_restores(ckpt: Path, quantization: str | None, device: torch.device) -> None:
    """A delta written in place (live scatters, requantized weights) and then aborted with rollback leaves
    every engine tensor as the last full update left it."""
    spec = QUANTIZATION_NAMES[quantization] if quantization else None
    engine = ReferenceEngine.from_checkpoint(ckpt, quantization=spec, device=device)
    delta_apply.keep_delta_base(engine.model, "device")
    base = ReceiverDeltaBase()

    def session(weights: dict[str, torch.Tensor], version: int) -> Any:
        return begin_update(engine.model, Manifest.from_named_tensors(weights.items(), version=version),
                            version=version, rollback=True)

    old = {n: t.to(device, torch.bfloat16) for n, t in CheckpointSource(ckpt)}
    first = DeltaSession(session(old, 1), base, "full")
    first.load(list(old.items()))
    first.finish()
    before = _state(engine)
    new = {n: t.to(device) for n, t in _change({n: t.cpu() for n, t in old.items()}, 2).items()}
    delta = DeltaSession(session(new, 2), base, "delta")
    delta.load([(n, encode_delta(new[n], old[n])) for n in new])
    delta._update.apply_staged()  # on a device the deltas wait for the finish's batch; write them now
    assert delta._update.num_in_place == len(new)  # every key applied in place
    assert not _equal(_state(engine), before)  # written in place before the abort
    delta.abort("the test aborts")
    assert _equal(_state(engine), before)


@pytest.mark.parametrize("quantization", [None, "fp8_block"])
def test_an_aborted_delta_with_rollback_restores_every_in_place_write(qwen3_a: Path, quantization: str | None) -> None:
    abort_restores(qwen3_a, quantization, torch.device("cpu"))
