"""On CUDA, a staged version is committed into the tensors the decode graph was captured with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from weight_sync.engine import ReferenceEngine, VersionSpan
from weight_sync.manifest import Manifest
from weight_sync.reload.staged import StagingConfig
from weight_sync.safetensors_io import iter_checkpoint
from weight_sync.transport import push_to_staging

PROMPTS = [[5, 6, 7], [20, 21, 22, 23, 24], [9]]
NEW = 12


@pytest.mark.gpu
@pytest.mark.parametrize("placement", ["device", "host"])
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_a_commit_mid_generation_keeps_the_graph_and_continues_like_a_fresh_engine(
    placement: str, quant: str | None, qwen3_a: Path, qwen3_b: Path,
) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda", quantization=quant)
    staging = engine.enable_staging(StagingConfig(placement=placement), kv_after_commit="recompute")
    assert staging.placement == placement
    engine.generate(PROMPTS, 4)  # captures the decode graph
    graph = engine._graph
    items = list(iter_checkpoint(qwen3_b))
    k = 5

    def stage(n: int) -> None:
        if n == k:
            push_to_staging(staging, items, Manifest.from_named_tensors(items), version=2).wait(120)

    got = engine.generate_with_versions(PROMPTS, NEW, on_step=stage)
    assert engine._graph is graph  # no recapture: the commit wrote into the captured tensors
    assert all(r.weight_versions == (VersionSpan("initial", 0, k), VersionSpan(2, k, NEW)) for r in got)
    if placement == "device" or quant is None:
        # A host twin quantizes on the CPU, which may differ bitwise from the GPU's quantization.
        fresh = ReferenceEngine.from_checkpoint(qwen3_b, device="cuda", quantization=quant)
        assert engine.fingerprint() == fresh.fingerprint()
        if quant is None:
            # Per-tensor fp8 quantizes activations with one dynamic scale over the whole (padded) batch
            # (torch._scaled_mm), so its tokens depend on the batch's composition, as vLLM's do
            # (docs/vllm.md): the recomputed prefill and a fresh engine's differ in padding. Equal kernel
            # bytes are the claim for fp8; tokens are compared where the arithmetic is batch-invariant.
            continued = fresh.generate([p + r.token_ids[:k] for p, r in zip(PROMPTS, got)], NEW - k)
            assert [r.token_ids[k:] for r in got] == continued
    staging.close()


@pytest.mark.gpu
def test_a_host_twin_of_a_cuda_engine_is_page_locked_for_an_asynchronous_commit(qwen3_a: Path, qwen3_b: Path) -> None:
    engine = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda")
    staging = engine.enable_staging(StagingConfig(placement="host"))
    assert staging.device == torch.device("cpu")
    assert all(src.is_pinned() for _, src in staging._pairs)
    items = list(iter_checkpoint(qwen3_b))
    push_to_staging(staging, items, Manifest.from_named_tensors(items), version=2).wait(120)
    report = engine.commit_staged()
    assert report is not None and report.placement == "host" and report.num_bytes == staging.num_bytes
    assert engine.generate(PROMPTS, 6) == ReferenceEngine.from_checkpoint(qwen3_b, device="cuda").generate(PROMPTS, 6)
    staging.close()


@pytest.mark.gpu
def test_a_twin_over_the_device_budget_is_staged_in_host_memory_or_refused(qwen3_a: Path) -> None:
    from weight_sync.errors import ConfigError

    engine = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda")
    assert engine.enable_staging(StagingConfig(device_budget_bytes=1)).placement == "host"
    other = ReferenceEngine.from_checkpoint(qwen3_a, device="cuda")
    with pytest.raises(ConfigError, match="over the device budget"):
        other.enable_staging(StagingConfig(placement="device", device_budget_bytes=1))
