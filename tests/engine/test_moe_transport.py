"""The tiny Qwen3-MoE through the transports (gloo, shm) into reference engines: equal to fresh loads."""

from __future__ import annotations

import pytest

from tests.engine.moe_transport_ranks import moe_updates
from weight_sync.testing import make_checkpoint, run_distributed

# Tiny preset: 8 experts of width 64, hidden 128, qkv rows (4 + 2 + 2) * 32; bf16 model format.
ONE_EXPERT_BYTES = 3 * 64 * 128 * 2
QKV_BYTES = 256 * 128 * 2


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("moe_transport")
    return [str(make_checkpoint(root / k, arch="qwen3_moe", seed=s)) for k, s in (("a", 0), ("b", 1))]


@pytest.mark.parametrize(("backend", "zero_copy", "quantization", "ep"), [
    ("gloo", False, None, 1),
    ("gloo", False, "fp8", 1),
    ("shm", False, "fp8", 1),
    ("shm", True, "fp8_block", 1),
    ("gloo", False, "fp8", 2),
], ids=["gloo-bf16", "gloo-fp8", "shm-fp8", "shm_zero_copy-fp8_block", "gloo-fp8-ep2"])
def test_moe_updates_over_a_transport_equal_fresh_loads_and_buffer_one_expert_at_a_time(
    backend, zero_copy, quantization, ep, moe
) -> None:
    a, b = moe
    results = run_distributed(moe_updates, 1 + ep, backend, [a, b, a], quantization, ep > 1, zero_copy,
                              timeout_s=240)
    trainer, engines = results[0], results[1:]
    if not zero_copy:
        assert min(trainer["buckets"]) > 3, "32 KiB buckets cut the experts over several buckets"
    for rank, e in enumerate(engines, start=1):
        assert e["fingerprints"] == e["fresh"], f"rank {rank}"  # B, then A again: bitwise fresh loads
        for report in e["reports"]:
            if quantization is None:
                assert report["peak_buffered_bytes"] == 0  # bf16 experts are written in place
                continue
            if quantization == "fp8":
                # Per-tensor scales of whole experts: each expert's bands are quantized together once
                # its rows are in (no unit staging); an expert cut over two buckets keeps its first half.
                assert report["units_processed"] == 0
                assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(report["layers_banded"])
            else:
                # Every local expert (8, or 4 per EP rank, per layer) completed and was quantized on its own.
                assert report["units_processed"] == 2 * 8 // ep
            assert report["peak_buffered_bytes"] <= max(ONE_EXPERT_BYTES, QKV_BYTES), f"rank {rank}"
            assert report["spilled_bytes"] == 0
