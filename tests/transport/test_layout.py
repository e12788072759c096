"""Bucket layouts: every byte once, aligned, complete blocks, identical on both ends."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine runs GPU tests without it
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.errors import ManifestError
from weight_sync.manifest import TensorMeta
from weight_sync.transport import ALIGN_BYTES, check_block_order, plan_buckets


def _model_metas(num_blocks: int, sizes: list[int]) -> list[TensorMeta]:
    metas = [TensorMeta("model.embed_tokens.weight", torch.bfloat16, (sizes[0],))]
    for b in range(num_blocks):
        for j, n in enumerate(sizes[1:]):
            metas.append(TensorMeta(f"model.layers.{b}.t{j}.weight", torch.bfloat16, (n,)))
    metas.append(TensorMeta("lm_head.weight", torch.float32, (sizes[0],)))
    return metas


@settings(max_examples=60, deadline=None)
@given(
    num_blocks=st.integers(1, 5),
    sizes=st.lists(st.integers(0, 3000), min_size=2, max_size=5),
    bucket_units=st.integers(4, 40),
)
def test_layout_covers_every_byte_once_aligned_and_within_the_bucket(num_blocks: int, sizes: list[int], bucket_units: int) -> None:
    metas = _model_metas(num_blocks, sizes)
    bucket_bytes = bucket_units * ALIGN_BYTES
    layout = plan_buckets(metas, bucket_bytes, ALIGN_BYTES)
    covered: dict[int, list[tuple[int, int]]] = {}
    for b in layout.buckets:
        assert 0 < b.payload_bytes <= bucket_bytes or (b.payload_bytes == 0 and all(s.nbytes == 0 for s in b.segments))
        assert b.payload_bytes % ALIGN_BYTES == 0
        end = 0
        for s in b.segments:
            assert s.bucket_offset % ALIGN_BYTES == 0 and s.bucket_offset >= end
            end = s.bucket_offset + s.nbytes
            covered.setdefault(s.index, []).append((s.tensor_offset, s.nbytes))
        assert end <= b.payload_bytes
    for i, m in enumerate(metas):
        parts = covered[i]
        assert parts[0][0] == 0 and sum(n for _, n in parts) == m.nbytes
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(parts)), "segments continue in order"
    # Deterministic: both ends compute the same layout.
    assert plan_buckets(metas, bucket_bytes, ALIGN_BYTES).digest() == layout.digest()


def test_a_block_that_fits_is_never_split_across_buckets() -> None:
    metas = _model_metas(4, [512, 1024, 1024, 512])  # blocks of 3 KiB (bf16: 2 bytes per element)
    layout = plan_buckets(metas, 8 * 1024, ALIGN_BYTES)
    bucket_of: dict[str, set[int]] = {}
    for b in layout.buckets:
        for s in b.segments:
            block = ".".join(metas[s.index].name.split(".")[:3])
            bucket_of.setdefault(block, set()).add(b.index)
    assert all(len(v) == 1 for k, v in bucket_of.items() if k.startswith("model.layers")), bucket_of
    assert layout.max_split_bytes == 0


def test_a_tensor_larger_than_a_bucket_is_split_and_its_size_recorded() -> None:
    metas = [TensorMeta("model.embed_tokens.weight", torch.bfloat16, (10_000,))]
    layout = plan_buckets(metas, 4096, ALIGN_BYTES)
    assert layout.num_buckets == 5 and layout.max_split_bytes == 20_000


def test_a_manifest_out_of_block_order_is_rejected_with_the_first_misplaced_name() -> None:
    with pytest.raises(ManifestError, match=r"position 1 holds 'model.layers.1.a', block order expects 'model.layers.0.b'"):
        check_block_order(["model.layers.0.a", "model.layers.1.a", "model.layers.0.b", "model.layers.1.b"])
    check_block_order(["model.embed.w", "model.layers.0.a", "model.layers.1.a", "model.norm.w"])


def test_a_delta_wire_manifest_keeps_names_order_and_version_and_refuses_bad_sizes() -> None:
    from weight_sync.manifest import Manifest
    from weight_sync.transport.delta_sync import wire_manifest

    manifest = Manifest(tuple(_model_metas(2, [64, 32, 16])), version=7)
    sizes = [100 + i for i in range(len(manifest))]
    wire = wire_manifest(manifest, sizes)
    # Entries equal to checked ones: same names in the same order, uint8, one dimension of the encoded size.
    assert list(wire) == [TensorMeta(m.name, torch.uint8, (n,)) for m, n in zip(manifest, sizes)]
    assert wire.version == 7 and wire["lm_head.weight"].shape == (100 + len(manifest) - 1,)
    with pytest.raises(ManifestError, match=r"non-negative.*-1"):
        wire_manifest(manifest, [*sizes[:-1], -1])
    with pytest.raises(ManifestError, match="2 encoded sizes"):
        wire_manifest(manifest, sizes[:2])
