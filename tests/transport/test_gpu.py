"""CUDA paths (run on the device machine): NCCL between two GPUs, CUDA IPC on one, device checksums."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.transport.harness import gpu_flipped_byte, gpu_sync
from tests.transport.test_faults import _run_sender_failure
from weight_sync.checksum import ChecksumWorkspace, tensor_checksums
from weight_sync.manifest import tensor_checksum
from weight_sync.testing import run_distributed
from weight_sync.transport import bucket_checksum, checksum_value


@pytest.mark.gpu
def test_bucket_checksum_on_cuda_equals_the_cpu_checksum() -> None:
    data = torch.randint(0, 256, (4 * (3 * 65521 + 11),), dtype=torch.uint8)
    assert checksum_value(bucket_checksum(data.cuda()), data.numel()) == tensor_checksum(data)
    ws = ChecksumWorkspace(torch.device("cuda"))
    on_device = data.cuda()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = bucket_checksum(on_device, workspace=ws)
    assert checksum_value(got, data.numel()) == tensor_checksum(data)
    # Only the reductions' own scratch (a few KB), none of the 1.3 MB of intermediates.
    assert torch.cuda.max_memory_allocated() - before < 64 << 10


@pytest.mark.gpu
def test_checksums_of_many_cuda_tensors_at_once_equal_their_cpu_checksums() -> None:
    tensors = [torch.randn(n, 129).to(torch.bfloat16) for n in (1, 64, 513)] + [torch.randn(3).to(torch.uint8)]
    # Several 65521-word chunks per tensor (one grouped Triton launch), and a view 2 bytes into its storage.
    tensors += [torch.randn(300, 4096).to(torch.bfloat16), torch.randint(-2**31, 2**31 - 1, (65521 * 3 + 5,),
                                                                         dtype=torch.int32)]
    odd = torch.randn(1001).to(torch.bfloat16).cuda()[1:]
    # Read in element order whatever the layout: transposed, and expanded (a stride of 0, as vLLM makes
    # some scales); a 3-D tensor with a size-1 dimension of odd stride is contiguous and read in place.
    transposed = torch.randn(64, 96).cuda().t()
    expanded = torch.randn(1, 8).cuda().expand(4, 8)
    size_one = torch.randn(6, 1, 8).cuda().as_strided((6, 1, 8), (8, 99, 1))
    others = [odd, transposed, expanded, size_one]
    assert tensor_checksums([t.cuda() for t in tensors] + others) == [tensor_checksum(t) for t in tensors] + [
        tensor_checksum(t.cpu().contiguous()) for t in others]


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


@pytest.mark.gpu
@pytest.mark.parametrize(("temporaries", "engines"), [(False, 1), (True, 1), (False, 2)],
                         ids=["trainer tensors", "temporaries", "two engines"])
def test_zero_copy_ipc_equals_a_fresh_load_and_leaves_no_export_behind(temporaries: bool, engines: int,
                                                                        qwen3_a: Path, qwen3_b: Path) -> None:
    # Two engine processes on the same GPU each import their own export of every storage.
    trainer, *others = run_distributed(gpu_sync, 1 + engines, "ipc", str(qwen3_a), str(qwen3_b), None, 6, 1 << 20,
                                       "deferred", True, True, temporaries, timeout_s=400)
    for engine in others:
        assert engine["fingerprints"] == engine["expected"]
        assert len(set(engine["allocated"][1:])) == 1, engine["allocated"]
    engine = others[0]
    assert trainer["num_buckets"] == 0
    n = len(engine["fingerprints"])  # updates
    if not temporaries:
        # Two sets of trainer tensors sent in turn: each storage exported once, at its first update.
        assert trainer["zero_copy"]["exported"] == trainer["zero_copy"]["regions"]
    else:
        assert trainer["zero_copy"]["exported"] > n, trainer["zero_copy"]
    # Temporaries die after their update; the engine releases their imports at the commit and
    # ipc_collect frees them: the trainer's memory is the same after every update.
    assert len(set(trainer["allocated"])) == 1, trainer["allocated"]
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


# Ordering: with deferred verification the host queues loads before the bytes arrive (nccl) or before
# the sender's packing ran (ipc), and buffers are reused behind device events only. 16 KiB buckets cut
# the tiny model (1.1 MB) into ~70 buckets per update (64 KiB gave 19 on the H200 run of 2026-11-30, below
# the precondition) and each update differs from the last, so a load that ran
# before its receive / packing, or a receive or packing that overwrote a buffer still being read, leaves
# a fingerprint different from a fresh load.
@pytest.mark.multi_gpu
@pytest.mark.parametrize("verify", ["deferred", "before_load"])
def test_many_nccl_updates_with_small_buckets_stay_bitwise_equal_to_fresh_loads(verify: str, qwen3_a: Path,
                                                                                qwen3_b: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    trainer, engine = run_distributed(gpu_sync, 2, "nccl", str(qwen3_a), str(qwen3_b), None, 20, 16 << 10, verify,
                                      True, timeout_s=600)
    assert trainer["num_buckets"] > 50
    assert engine["fingerprints"] == engine["expected"]
    waits = trainer["receiver_waits"]
    expected_readbacks = 1 if verify == "deferred" else trainer["num_buckets"]
    assert all(w["readback"] == expected_readbacks for w in waits), waits
    assert len(set(trainer["allocated"][2:])) == 1 and len(set(engine["allocated"][2:])) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("verify", ["deferred", "before_load"])
def test_many_ipc_updates_with_small_buckets_stay_bitwise_equal_to_fresh_loads(verify: str, qwen3_a: Path,
                                                                              qwen3_b: Path) -> None:
    trainer, engine = run_distributed(gpu_sync, 2, "ipc", str(qwen3_a), str(qwen3_b), None, 20, 16 << 10, verify,
                                      True, timeout_s=600)
    assert trainer["num_buckets"] > 50
    assert engine["fingerprints"] == engine["expected"]
    expected_readbacks = 1 if verify == "deferred" else trainer["num_buckets"]
    assert all(w["readback"] == expected_readbacks for w in trainer["receiver_waits"])
    assert trainer["leftover"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_a_byte_flipped_on_the_gpu_fails_the_update_everywhere_and_rolls_the_engine_back(
    backend: str, qwen3_a: Path, qwen3_b: Path
) -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    trainer, engine = run_distributed(gpu_flipped_byte, 2, backend, str(qwen3_a), str(qwen3_b), "deferred",
                                      timeout_s=400)
    assert trainer["outcomes"] == ["AgreedChecksumError", "ok"]
    assert engine["outcomes"] == ["AgreedChecksumError", "ok"]
    assert engine["rolled_back"] and engine["torn"] is None
    assert engine["final_is_fresh"]


@pytest.mark.gpu
def test_a_killed_ipc_sender_makes_the_receiver_raise_within_twice_the_timeout(qwen3_a: Path, qwen3_b: Path) -> None:
    # The receiver's compute stream waits on the sender's packing events: a sender that dies mid-update
    # must still end in an error within the bound, with the engine rolled back or (if its stream could
    # not drain) torn, never silently mixed.
    timeout_s = 10.0
    outcomes, killed_at = _run_sender_failure("kill", "ipc", qwen3_a, qwen3_b, timeout_s, rollback=True,
                                              engine_device="cuda:0", num_receivers=1)
    for o in outcomes:
        assert o["error"] in ("TransportError", "TransportTimeout"), o
        assert o["raised_at"] - killed_at <= 2 * timeout_s, o
        assert o["rolled_back"] != o["torn"], o
