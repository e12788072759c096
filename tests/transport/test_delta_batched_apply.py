"""Deltas that arrive on a device are applied in batches (``keep_delta_base(batch_bytes=...)``): queued
keys count as arrived, the batch is applied when full or before the finish, a key sent twice is still
refused, and an abort drops what was queued; the engine ends bitwise equal to a full reload either way.
(The batching runs on CPU here through ``InPlaceUpdate.stage_host``; CUDA runs it by default.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transport.test_delta_grouped import _change, _equal, _session, _state
from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ConfigError, DuplicateTensorError
from weight_sync.quant import QUANTIZATION_NAMES
from weight_sync.reload import delta_apply
from weight_sync.transport.delta import encode_delta
from weight_sync.transport.delta_sync import DeltaSession, ReceiverDeltaBase


@pytest.fixture(autouse=True)
def _batch_host_payloads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(delta_apply.InPlaceUpdate, "stage_host", True)


_CPU = torch.device("cpu")


def _engines(ckpt: Path, batch_bytes: int, device: torch.device = _CPU
             ) -> tuple[ReferenceEngine, ReferenceEngine, ReceiverDeltaBase, dict]:
    """Two fp8_block engines on ``device`` (the first keeps a delta base, model-format copies on the
    device on CUDA, pinned on the host otherwise), the first loaded in full; the host bf16 weights."""
    spec = QUANTIZATION_NAMES["fp8_block"]
    delta, full = (ReferenceEngine.from_checkpoint(ckpt, quantization=spec, device=device) for _ in range(2))
    delta_apply.keep_delta_base(delta.model, "device" if device.type == "cuda" else "pinned", batch_bytes=batch_bytes)
    base = ReceiverDeltaBase()
    old = {n: t.to(torch.bfloat16) for n, t in CheckpointSource(ckpt)}
    first = DeltaSession(_session(delta, old, 1), base, "full")
    first.load([(n, t.to(device)) for n, t in old.items()])
    first.finish()
    return delta, full, base, old


@pytest.mark.parametrize("batch_bytes", [0, 1, 1 << 30])
def test_deltas_loaded_in_several_calls_equal_a_full_reload_whatever_the_batch(qwen3_a: Path, batch_bytes: int) -> None:
    delta, full, base, old = _engines(qwen3_a, batch_bytes)
    new = _change(old, 2)
    session = DeltaSession(_session(delta, new, 2), base, "delta")
    names = list(new)
    for part in (names[: len(names) // 3], names[len(names) // 3 :]):
        session.load([(n, encode_delta(new[n], old[n])) for n in part])
    assert session.missing() == []  # queued keys count as arrived
    report = session.finish()
    reload = _session(full, new, 2)
    reload.load(list(new.items()))
    reload.finish()
    assert base.last_stats["in_place"] == len(new)
    assert _equal(_state(delta), _state(full))
    assert report.fingerprint == full.fingerprint()


def test_a_key_queued_in_one_call_and_sent_again_is_refused_and_nothing_is_written(qwen3_a: Path) -> None:
    delta, _, base, old = _engines(qwen3_a, 1 << 30)
    before = _state(delta)
    new = _change(old, 2)
    session = DeltaSession(_session(delta, new, 2), base, "delta")
    name = next(iter(new))
    session.load([(name, encode_delta(new[name], old[name]))])
    with pytest.raises(DuplicateTensorError, match="arrived twice"):
        session.load([(name, encode_delta(new[name], old[name]))])
    assert _equal(_state(delta), before)  # the queued delta was dropped with the failed update


def test_keep_delta_base_refuses_a_negative_or_non_integer_batch(qwen3_a: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    for bad in (-1, 1.5, True, "64MiB"):
        with pytest.raises(ConfigError, match="batch_bytes"):
            delta_apply.keep_delta_base(engine.model, "device", batch_bytes=bad)  # type: ignore[arg-type]
