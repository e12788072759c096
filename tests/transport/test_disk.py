"""The disk backend: safetensors directories published atomically and applied in block order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ChecksumError, ManifestError, TransportTimeout
from weight_sync.reload import torn_reason
from weight_sync.safetensors_io import read_header
from weight_sync.transport import TransportConfig, WeightReceiver, WeightSender


def _sender(tmp_path: Path, **kw) -> WeightSender:
    sender = WeightSender(TransportConfig(backend="disk", directory=str(tmp_path / "updates"), bucket_bytes=64 << 10,
                                          **kw))
    sender.connect()
    return sender


def test_disk_updates_equal_a_fresh_load_and_old_versions_are_pruned(tmp_path: Path, qwen3_a: Path, qwen3_b: Path) -> None:
    sender = _sender(tmp_path, keep_versions=2)
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    receiver = WeightReceiver(engine, sender.address, backend="disk")
    receiver.connect()
    for version, ckpt in ((1, qwen3_b), (2, qwen3_a), (3, qwen3_b)):
        src = CheckpointSource(ckpt)
        sender.send(src, src.manifest(), version=version)
        report = receiver.receive_update(timeout_s=5)
        assert report.version == version == receiver.weight_version
        assert report.fingerprint == ReferenceEngine.from_checkpoint(ckpt).fingerprint()
    kept = sorted(p.name for p in (tmp_path / "updates").iterdir() if p.name.startswith("update-"))
    assert kept == ["update-00000002", "update-00000003"]
    # Files hold complete tensors in block order, each a valid safetensors file.
    files = json.loads((tmp_path / "updates" / "update-00000003" / "manifest.json").read_text())["files"]
    assert len(files) > 3
    for f in files:
        header = read_header(tmp_path / "updates" / "update-00000003" / f["file"])
        assert set(header) == {e["name"] for e in f["tensors"]}


def test_a_corrupted_disk_update_fails_its_checksum_and_rolls_back(tmp_path: Path, qwen3_a: Path, qwen3_b: Path) -> None:
    sender = _sender(tmp_path)
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    before = engine.fingerprint()
    receiver = WeightReceiver(engine, sender.address, backend="disk", rollback=True)
    receiver.connect()
    src = CheckpointSource(qwen3_b)
    sender.send(src, src.manifest(), version=1)
    update = tmp_path / "updates" / "update-00000001"
    last = sorted(update.glob("*.safetensors"))[-1]
    raw = bytearray(last.read_bytes())
    raw[-3] ^= 0xFF
    last.write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="checksum"):
        receiver.receive_update(timeout_s=5)
    assert engine.fingerprint() == before and torn_reason(engine.model) is None


def test_a_disk_manifest_the_engine_rejects_fails_before_any_write(tmp_path: Path, qwen3_a: Path, qwen3_b: Path) -> None:
    sender = _sender(tmp_path)
    engine = ReferenceEngine.from_checkpoint(qwen3_a)
    before = engine.fingerprint()
    receiver = WeightReceiver(engine, sender.address, backend="disk")
    receiver.connect()
    src = CheckpointSource(qwen3_b)
    renamed = ((n.replace("model.norm", "model.final_norm"), t) for n, t in src)
    manifest = [type(m)(m.name.replace("model.norm", "model.final_norm"), m.dtype, m.shape) for m in src.manifest()]
    sender.send(renamed, manifest, version=1)
    with pytest.raises((ManifestError, KeyError), match="final_norm"):
        receiver.receive_update(timeout_s=5)
    assert engine.fingerprint() == before and torn_reason(engine.model) is None


def test_a_disk_receiver_waits_for_a_newer_update_with_a_timeout(tmp_path: Path, qwen3_a: Path) -> None:
    sender = _sender(tmp_path)
    receiver = WeightReceiver(ReferenceEngine.from_checkpoint(qwen3_a), sender.address, backend="disk")
    receiver.connect()
    with pytest.raises(TransportTimeout, match="no update newer than 0"):
        receiver.start_weight_update(timeout_s=0.2)


def test_a_source_that_disagrees_with_the_manifest_publishes_nothing(tmp_path: Path, qwen3_b: Path) -> None:
    sender = _sender(tmp_path)
    src = CheckpointSource(qwen3_b)
    sender.start_weight_update(src.manifest(), version=1)
    with pytest.raises(ManifestError, match="position 0 was announced"):
        sender.update_weights((n, t.to(torch.float32)) for n, t in src)
    assert not (tmp_path / "updates" / "LATEST").exists()
    assert [p.name for p in (tmp_path / "updates").iterdir()] == []
