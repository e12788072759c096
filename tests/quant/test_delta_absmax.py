"""The absmax a delta keeps (per block tile, per tensor) moves with the changes to exactly what a read of
the new weights gives, on every branch of the rule, and the kernel tensors stay bitwise equal to a full
quantization of the new weights."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from weight_sync.quant import make_linear_method
from weight_sync.quant.delta import (
    _absmax_from_scale,
    _read_tile_absmax,
    apply_quantized_delta_,
    delta_absmax,
)
from weight_sync.quant.fp8 import _EPS, _absmax, _scale
from weight_sync.quant.online import reduce_max
from weight_sync.testing import run_distributed

Change = tuple[list[int], list[float]]  # flat positions, their new values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t.view(torch.int32)


def _assert_same_state(state: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equal, a NaN matching any NaN (the state's NaN sends its tile to a read, whatever its bits)."""
    assert torch.equal(state.isnan(), want.isnan())
    assert torch.equal(_bits(state.nan_to_num(0.0)), _bits(want.nan_to_num(0.0)))


def _true_absmax(name: str, base: torch.Tensor) -> torch.Tensor:
    if name == "fp8":
        return _absmax(base).clamp(min=_EPS).reshape(1)
    return _read_tile_absmax(base, 128, 128, base.device)


def _apply_all(name: str, base: torch.Tensor, changes: list[Change], keep_state: bool) -> None:
    """Apply ``changes`` one delta after another (the kept state carried along, or made afresh for each)
    and check every step against a full quantization of the new weights and a read of its absmax."""
    method = make_linear_method(name)
    q, s = (t.clone() for t in method.quantize(base, None))
    state = delta_absmax(method, base, s) if keep_state else None
    for positions, values in changes:
        pos = torch.tensor(positions, dtype=torch.int64)
        apply_quantized_delta_(method, base, pos, torch.tensor(values, dtype=torch.float32).to(base.dtype), q, s,
                               absmax=state)
        q_full, s_full = method.quantize(base, None)
        assert torch.equal(_bits(q), _bits(q_full))
        assert torch.equal(_bits(s), _bits(s_full.reshape(s.shape)))
        if state is not None:
            _assert_same_state(state, _true_absmax(name, base))


def _weights(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(dtype)


def _argmax_abs(base: torch.Tensor, rows: slice, cols: slice) -> int:
    """Flat position of the largest |x| inside ``base[rows, cols]``."""
    tile = base[rows, cols].float().abs()
    r, c = divmod(int(tile.argmax()), tile.shape[1])
    return (rows.start + r) * base.shape[1] + cols.start + c


def _branch_changes(base: torch.Tensor) -> dict[str, list[Change]]:
    """Delta sequences that drive tile (0, 1) / the tensor through each branch of the absmax rule."""
    k = base.shape[1]
    top = _argmax_abs(base, slice(0, 128), slice(128, 256))
    peak = float(base.view(-1)[top].float().abs())
    inner = 5 * k + 130  # tile (0, 1), not its max element (the weights are random: a tie is no concern)
    return {
        "new max above the old one": [([inner], [peak * 4]), ([inner + 1], [-peak * 8])],
        "the max element lowered": [([top], [0.0]), ([inner], [peak * 4]), ([inner], [0.0])],
        "the max element rewritten unchanged": [([top, inner], [float(base.view(-1)[top]), 0.001])],
        "the max element doubled, then one copy lowered": [([inner], [peak]), ([top], [peak / 2]),
                                                            ([inner], [peak / 4])],
        "changes below the max": [([inner, inner + 7, 3 * k + 200], [peak / 3, -peak / 5, 0.0])],
        "a tile zeroed, then tiny values, then a normal one": [
            ([r * k + c for r in range(128) for c in range(128, 256)], [0.0] * 128 * 128),
            ([inner], [1e-13]), ([inner + 1], [-3e-12]), ([inner], [0.5])],
        "empty delta": [([], [])],
        "every element changed": [(list(range(base.numel())), (-base.float().view(-1) * 1.5 + 0.01).tolist())],
        "inf, then finite again": [([inner], [math.inf]), ([inner], [0.25])],
        "nan, then finite again": [([inner], [math.nan]), ([inner], [0.25])],
    }


@pytest.mark.parametrize("keep_state", [True, False], ids=["kept state", "fresh state"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(256, 384), (200, 300)], ids=["whole tiles", "ragged edge tiles"])
@pytest.mark.parametrize("name", ["fp8_block", "fp8"])
@pytest.mark.parametrize("branch", list(_branch_changes(_weights((256, 384), torch.bfloat16))))
def test_every_branch_of_the_absmax_rule_gives_a_full_quantization_bit_for_bit(
    name: str, shape: tuple[int, int], dtype: torch.dtype, keep_state: bool, branch: str
) -> None:
    base = _weights(shape, dtype)
    _apply_all(name, base, _branch_changes(base)[branch], keep_state)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_change_in_a_ragged_edge_tile_moves_that_tile_alone(dtype: torch.dtype) -> None:
    base = _weights((200, 300), dtype, seed=3)
    k = base.shape[1]
    corner = 199 * k + 299  # the last element: tile (1, 2), 72 x 44 of it inside the weight
    peak = float(_absmax(base[128:, 256:]))
    changes = [([corner], [peak * 3]), ([corner], [0.0]), ([130 * k + 260], [-peak * 2])]
    _apply_all("fp8_block", base, changes, keep_state=True)


def test_many_deltas_in_a_row_keep_the_state_of_the_weights_they_leave() -> None:
    base = _weights((384, 256), torch.bfloat16, seed=5)
    g = torch.Generator().manual_seed(6)
    changes = []
    for step in range(6):
        pos = torch.randperm(base.numel(), generator=g)[: int(base.numel() * (0.02 if step % 2 else 0.3))]
        vals = torch.randn(pos.numel(), generator=g) * 0.03
        changes.append((pos.tolist(), vals.tolist()))
    for name in ("fp8_block", "fp8"):
        _apply_all(name, base.clone(), changes, keep_state=True)


def test_the_absmax_recovered_from_a_scale_is_the_clamped_absmax_for_every_2_byte_value() -> None:
    for dtype, bits in ((torch.bfloat16, torch.int16), (torch.float16, torch.int16)):
        every = torch.arange(0, 1 << 15, dtype=torch.int32).to(bits).view(dtype)  # every non-negative pattern
        finite = every[torch.isfinite(every)].float()
        want = finite.clamp(min=_EPS)
        assert torch.equal(_bits(_absmax_from_scale(_scale(finite), dtype)), _bits(want))
        odd = _absmax_from_scale(_scale(torch.tensor([math.inf, math.nan])), dtype)
        assert not torch.isfinite(odd).any()


def test_a_kept_state_of_another_shape_is_refused() -> None:
    from weight_sync.errors import LayoutMismatchError

    method = make_linear_method("fp8_block")
    base = _weights((256, 256), torch.bfloat16)
    q, s = method.quantize(base, None)
    with pytest.raises(LayoutMismatchError, match="absmax state"):
        apply_quantized_delta_(method, base, torch.tensor([0]), torch.ones(1), q, s, absmax=torch.ones(1))


def _tp_rank(rank: int, world: int, lowered: bool) -> bool:
    """One shard of a per-tensor fp8 weight per rank; deltas on rank 0 only move the shared scale."""
    method = make_linear_method("fp8")
    group = dist.new_group(list(range(world)))
    base = _weights((64, 128), torch.bfloat16, seed=rank)
    q, s = (t.clone() for t in method.quantize(base, group))
    state = delta_absmax(method, base, s)
    peak = float(reduce_max(_absmax(base).reshape(1), group)[0])
    top = int(base.float().abs().view(-1).argmax())
    steps = [([top], [peak * 2]), ([top], [0.0])] if lowered else [([7], [peak / 2]), ([top], [peak * 3])]
    ok = True
    for positions, values in steps:
        pos = torch.tensor(positions if rank == 0 else [], dtype=torch.int64)
        vals = torch.tensor(values if rank == 0 else [], dtype=torch.float32)
        apply_quantized_delta_(method, base, pos, vals, q, s, group, absmax=state)
        q_full, s_full = method.quantize(base, group)
        ok &= torch.equal(_bits(q), _bits(q_full)) and torch.equal(_bits(s), _bits(s_full.reshape(s.shape)))
        ok &= torch.equal(_bits(state), _bits(_absmax(base).clamp(min=_EPS).reshape(1)))  # finite here
    return ok


@pytest.mark.parametrize("lowered", [False, True], ids=["raised", "raised then lowered"])
def test_a_per_tensor_scale_over_a_tp_group_follows_the_kept_shard_absmaxes(lowered: bool) -> None:
    assert run_distributed(_tp_rank, 2, lowered) == [True, True]
