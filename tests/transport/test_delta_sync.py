"""Delta sync over gloo: each delta update leaves the engines bitwise equal to a fresh load of the same
weights (bf16 and every quantization), a delta on a wrong base is refused before any write and the
sender's own full fallback lands, and a corrupt delta bucket rolls the engine back whole."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.transport.harness import _flip_byte_in_bucket, connect_pair
from trainers import CheckpointSource
from weight_sync.engine import ReferenceEngine
from weight_sync.errors import ChecksumError, ConfigError
from weight_sync.manifest import Manifest
from weight_sync.quant import QUANTIZATION_NAMES
from weight_sync.testing import run_distributed
from weight_sync.transport import TransportConfig

NUM_UPDATES = 6
TAMPERED = 4  # the update whose base the sender misstates


def _versions(ckpt: str) -> list[dict[str, torch.Tensor]]:
    """Deterministic weights per version: v1 the checkpoint, then ~2% of each tensor's elements change,
    one tensor changes densely (plain chunks) and one not at all."""
    weights = dict(CheckpointSource(ckpt))
    out = [weights]
    for v in range(2, NUM_UPDATES + 1):
        g = torch.Generator().manual_seed(v)
        nxt = {}
        for i, (name, t) in enumerate(out[-1].items()):
            t = t.clone()
            if i == 1:
                pass  # unchanged
            elif i == 2:
                t += (torch.randn(t.shape, generator=g) * 0.01).to(t.dtype)
            else:
                mask = torch.rand(t.shape, generator=g) < 0.02
                t[mask] += (torch.randn(t.shape, generator=g) * 0.05).to(t.dtype)[mask]
            nxt[name] = t
        out.append(nxt)
    return out


def _fresh_fingerprint(ckpt: str, weights: dict[str, torch.Tensor], scratch: Path, quantization: Any,
                       group: Any) -> str:
    from safetensors.torch import save_file

    scratch.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(ckpt) / "config.json", scratch / "config.json")
    save_file({n: t.contiguous() for n, t in weights.items()}, str(scratch / "model.safetensors"))
    return ReferenceEngine.from_checkpoint(scratch, tp_group=group, quantization=quantization).fingerprint()


def delta_updates(rank: int, world: int, ckpt: str, quantization: Any, scratch: str) -> dict:
    end, engine, group = connect_pair(rank, world, "gloo", ckpt, quantization=quantization, rollback=True,
                                      config={"delta": True, "delta_chunk_elems": 1024})
    versions = _versions(ckpt)
    if rank == 0:
        manifest = Manifest.from_named_tensors(versions[0].items())
        stats = []
        for v, weights in enumerate(versions, start=1):
            if v == TAMPERED:
                end._delta.version = "not-what-the-engines-hold"
            report = end.send(weights.items(), manifest, version=v)
            stats.append({**report.delta, "num_bytes": report.num_bytes, "version": report.version})
        # A corrupt delta bucket (flipped on the engine side): every engine fails the update and rolls
        # back to the last version; both bases went with the failed update (the sender's moved to the
        # uncommitted bytes as it encoded, the engines' with the failed decode), so the next update is
        # sent in full and re-establishes them.
        weights = {n: t.clone() for n, t in versions[-1].items()}
        weights[next(iter(weights))].view(-1)[0] += 1
        error = None
        try:
            end.send(weights.items(), manifest, version=NUM_UPDATES + 1)
        except ChecksumError as e:
            error = type(e).__name__
        after = end.send(versions[-1].items(), manifest, version=NUM_UPDATES + 2)
        end.close()
        return {"stats": stats, "error": error, "after": after.delta}
    got, want, applied = [], [], []
    for v, weights in enumerate(versions, start=1):
        report = end.receive_update()
        got.append((end.weight_version, report.fingerprint))
        applied.append(dict(end._delta_base.last_stats))
        want.append((v, _fresh_fingerprint(ckpt, weights, Path(scratch) / f"r{rank}v{v}", quantization, group)))
    real_wait = end._plane.wait
    _flip_byte_in_bucket(end, 0)
    with pytest.raises(ChecksumError):
        end.receive_update()
    end._plane.wait = real_wait
    rolled_back = engine.fingerprint() == want[-1][1]
    end.receive_update()
    last = engine.fingerprint() == want[-1][1]
    end.close()
    return {"got": got, "want": want, "rolled_back": rolled_back, "last": last, "applied": applied,
            "quantized": quantization is not None, "num_tensors": len(versions[0])}


def _check(results: list[dict]) -> None:
    trainer, engines = results[0], results[1:]
    modes = [s["mode"] for s in trainer["stats"]]
    assert modes == ["full", "delta", "delta", "full", "delta", "delta"]
    assert "DeltaBaseError" in trainer["stats"][TAMPERED - 1]["reason"]
    for s in trainer["stats"][1:]:
        if s["mode"] == "delta":
            # ~2% of the elements change in most tensors: the wire carries a small part of the bytes.
            assert s["num_bytes"] == s["wire_bytes"] < 0.25 * s["plain_bytes"]
            assert 0.01 < s["changed_fraction"] < 0.2
    assert trainer["error"] == "AgreedChecksumError"
    assert trainer["after"]["mode"] == "full" and "no base committed" in trainer["after"]["reason"]
    for e in engines:
        assert e["got"] == e["want"]
        # Every key of a delta went in place (no tensor rebuilt, none loaded whole), and a quantized
        # engine requantized its layers from the model-format copies.
        for mode, applied in zip(modes, e["applied"]):
            assert applied["mode"] == mode
            if mode == "delta":
                assert applied["in_place"] == e["num_tensors"] and applied["through_session"] == 0
                assert (applied["requantized"] > 0) == e["quantized"]
        assert e["rolled_back"] and e["last"]


@pytest.mark.parametrize("quantization", [None, *sorted({str(c) for c in QUANTIZATION_NAMES.values()})])
def test_every_delta_update_equals_a_fresh_load_and_a_wrong_base_falls_back_to_a_full_update(
    quantization: str | None, qwen3_a: Path, tmp_path: Path
) -> None:
    spec = None if quantization is None else next(c for c in QUANTIZATION_NAMES.values() if str(c) == quantization)
    _check(run_distributed(delta_updates, 2, str(qwen3_a), spec, str(tmp_path), timeout_s=240))


def test_a_tensor_parallel_fp8_block_engine_takes_deltas_on_every_rank(qwen3_a: Path, tmp_path: Path) -> None:
    _check(run_distributed(delta_updates, 3, str(qwen3_a), "fp8_block", str(tmp_path), timeout_s=300))


def test_delta_needs_a_buffered_transport() -> None:
    with pytest.raises(ConfigError, match="buffered transport"):
        TransportConfig(backend="shm", zero_copy=True, checksum=False, delta=True)
    with pytest.raises(ConfigError, match="delta_base"):
        TransportConfig(delta=True, delta_base="disk")
