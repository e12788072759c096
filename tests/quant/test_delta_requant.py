"""Requantizing only what a delta changed gives the kernel tensors a full quantization of the new
weights gives, bit for bit, for every quantization in the registry."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # the device machine runs GPU tests without it
from hypothesis import given, settings
from hypothesis import strategies as st

from weight_sync.errors import LayoutMismatchError
from weight_sync.quant import QUANTIZATION_NAMES, make_linear_method
from weight_sync.quant.delta import apply_quantized_delta_, fused_positions
from weight_sync.transport.delta import apply_delta_, encode_delta

PATTERNS = ["empty", "one", "block", "dense", "all", "random", "outlier"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


def _new_weights(base: torch.Tensor, pattern: str, seed: int, density: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n, k = base.shape
    new = base.clone()
    if pattern == "one":
        new[int(torch.randint(n, (1,), generator=g)), int(torch.randint(k, (1,), generator=g))] *= 0.5
    elif pattern == "block":
        r, c = int(torch.randint(n, (1,), generator=g)), int(torch.randint(k, (1,), generator=g))
        new[r : r + 128, c : c + 128] += 0.01
    elif pattern in ("dense", "all", "random"):
        p = {"dense": 0.9, "all": 1.0, "random": density}[pattern]
        mask = torch.rand(n, k, generator=g) < p
        new[mask] += (torch.randn(n, k, generator=g) * 0.01).to(new.dtype)[mask]
    elif pattern == "outlier":  # moves the per-tensor (and that row's / tile's) amax
        new[int(torch.randint(n, (1,), generator=g)), 0] = 100.0
    return new


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(QUANTIZATION_NAMES)),
    shape=st.sampled_from([(256, 256), (200, 300), (130, 64), (1, 129)]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    pattern=st.sampled_from(PATTERNS),
    density=st.floats(0.0, 0.05),
    seed=st.integers(0, 2**16),
)
def test_requantizing_the_changed_parts_equals_a_full_quantization_of_the_new_weights(
    name: str, shape: tuple[int, int], dtype: torch.dtype, pattern: str, density: float, seed: int
) -> None:
    method = make_linear_method(QUANTIZATION_NAMES[name])
    old = (torch.randn(shape, generator=torch.Generator().manual_seed(seed))).to(dtype)
    new = _new_weights(old, pattern, seed + 1, density)
    q, s = (t.clone() for t in method.quantize(old, None))
    base = old.clone()
    # The positions and values come from the wire encoding, as the engine receives them.
    scratch = old.clone()
    positions = apply_delta_(scratch, encode_delta(new, old, chunk_elems=1024))
    apply_quantized_delta_(method, base, positions, new.view(-1)[positions], q, s)
    q_full, s_full = method.quantize(new, None)
    assert torch.equal(base, new)
    assert torch.equal(_bits(q), _bits(q_full))
    assert torch.equal(s.view(torch.int32), s_full.reshape(s.shape).view(torch.int32))


def test_block_scales_rewrite_only_the_tiles_that_hold_a_change() -> None:
    method = make_linear_method("fp8_block")
    old = torch.randn(512, 512).to(torch.bfloat16)
    q, s = (t.clone() for t in method.quantize(old, None))
    pos = torch.tensor([0, 130 * 512 + 300])  # tile (0, 0) and tile (1, 2)
    result = apply_quantized_delta_(method, old.clone(), pos, torch.tensor([3.0, -2.0]), q, s)
    assert (result.unit, result.num_units, result.full) == ("tile", 2, False)


def test_a_per_tensor_scale_is_recomputed_whole_only_when_the_amax_moves() -> None:
    method = make_linear_method("fp8")
    old = torch.randn(64, 64).to(torch.bfloat16)
    q, s = (t.clone() for t in method.quantize(old, None))
    small = apply_quantized_delta_(method, old.clone(), torch.tensor([5]), torch.tensor([0.001]), q, s)
    assert (small.unit, small.full) == ("element", False)
    big = apply_quantized_delta_(method, old.clone(), torch.tensor([5]), torch.tensor([50.0]), q, s)
    assert big.full


def test_per_channel_scales_rewrite_only_the_changed_rows() -> None:
    for name in ("fp8_per_channel", "int8"):
        method = make_linear_method(name)
        old = torch.randn(64, 32).to(torch.bfloat16)
        q, s = (t.clone() for t in method.quantize(old, None))
        result = apply_quantized_delta_(method, old.clone(), torch.tensor([3, 4, 40 * 32]), torch.ones(3), q, s)
        assert (result.unit, result.num_units, result.full) == ("row", 2, False)


@pytest.mark.parametrize("name", sorted(QUANTIZATION_NAMES))
def test_a_change_in_k_proj_reaches_the_fused_qkv_rows_it_lands_in(name: str) -> None:
    method = make_linear_method(QUANTIZATION_NAMES[name])
    qkv = {"q": torch.randn(256, 128), "k": torch.randn(128, 128), "v": torch.randn(128, 128)}
    qkv = {k: v.to(torch.bfloat16) for k, v in qkv.items()}
    fused = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
    q, s = (t.clone() for t in method.quantize(fused, None))
    new_k = qkv["k"].clone()
    new_k[7, 9] += 1.0
    new_k[100, :] *= 2
    positions = apply_delta_(qkv["k"].clone(), encode_delta(new_k, qkv["k"]))
    base = fused.clone()
    apply_quantized_delta_(method, base, fused_positions(positions, 256, 128), new_k.view(-1)[positions], q, s)
    q_full, s_full = method.quantize(torch.cat([qkv["q"], new_k, qkv["v"]]), None)
    assert torch.equal(_bits(q), _bits(q_full)) and torch.equal(s, s_full.reshape(s.shape))


def test_a_kernel_tensor_of_another_shape_is_refused() -> None:
    method = make_linear_method("fp8_block")
    q, s = method.quantize(torch.randn(128, 128), None)
    with pytest.raises(LayoutMismatchError, match="base's shape"):
        apply_quantized_delta_(method, torch.zeros(64, 128), torch.tensor([0]), torch.ones(1), q, s)
