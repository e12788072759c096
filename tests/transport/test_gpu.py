"""CUDA paths (run on the device machine): NCCL between two GPUs, CUDA IPC on one, device checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transport.harness import gpu_sync
from tests.transport.test_faults import _run_sender_failure
from weight_sync.manifest import tensor_checksum
from weight_sync.testing import run_distributed
from weight_sync.transport import bucket_checksum, checksum_value


@pytest.mark.gpu
def test_bucket_checksum_on_cuda_equals_the_cpu_checksum() -> None:
    data = torch.randint(0, 256, (4 * (3 * 65521 + 11),), dtype=torch.uint8)
    assert checksum_value(bucket_checksum(data.cuda()), data.numel()) == tensor_checksum(data)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("quantization", [None, "fp8_block"])
def test_nccl_sync_into_an_engine_on_another_gpu_equals_a_fresh_load(quantization, qwen3_a: Path, qwen3_b: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = run_distributed(gpu_sync, 2, "nccl", str(qwen3_a), str(qwen3_b), quantization, 5, timeout_s=400)
    trainer, engine = results
    assert engine["fingerprints"] == [engine["fresh"]] * 5
    assert [fps[0] for fps in trainer["fingerprints"]] == engine["fingerprints"]
    # Buffers, streams and communicators are made once: no growth across updates on either GPU.
    assert len(set(trainer["allocated"][1:])) == 1, trainer["allocated"]
    assert len(set(engine["allocated"][1:])) == 1, engine["allocated"]


@pytest.mark.gpu
def test_ipc_sync_on_one_gpu_equals_a_fresh_load_and_releases_every_export(qwen3_a: Path, qwen3_b: Path) -> None:
    results = run_distributed(gpu_sync, 2, "ipc", str(qwen3_a), str(qwen3_b), None, 5, timeout_s=400)
    trainer, engine = results
    assert engine["fingerprints"] == [engine["fresh"]] * 5
    assert len(set(trainer["allocated"])) == 1, "one export per buffer: no allocation per update"
    assert len(set(engine["allocated"][1:])) == 1, engine["allocated"]
    # After the receiver released its single import of each buffer and the sender closed
    # (ipc_collect), none of the sender's transport memory is left.
    assert trainer["leftover"] == 0, trainer["leftover"]


@pytest.mark.multi_gpu
def test_a_killed_nccl_sender_makes_the_receivers_raise_within_twice_the_timeout(qwen3_a: Path, qwen3_b: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    timeout_s = 10.0
    outcomes, killed_at = _run_sender_failure("kill", "nccl", qwen3_a, qwen3_b, timeout_s, rollback=True,
                                              engine_device="cuda:1", num_receivers=1)
    for o in outcomes:
        assert o["error"] in ("TransportError", "TransportTimeout"), o
        assert o["raised_at"] - killed_at <= 2 * timeout_s, o
        assert o["rolled_back"] and not o["torn"]
