"""The grouped copy of a reload's small writes leaves every destination bitwise equal to ``copy_``.

``copy_many`` launches one Triton kernel for every 4-byte-aligned contiguous pair and hands the rest to
``torch._foreach_copy_``. On CPU the fallback runs, and the kernel itself runs under Triton's interpreter
in a child process; on the GPU (``gpu`` marker) the compiled kernel sees the shapes a MoE reload gives it
(3 MB expert slices into views of fused tensors) next to the ones it must route elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from weight_sync.reload.grouped_copy import _CHUNK, CopyGroup, copy_many


def _pairs(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Destinations and sources of every kind ``copy_many`` meets: aligned slices of fused tensors, odd
    byte lengths, 2-byte and 4-byte misaligned views, a non-contiguous view, an empty tensor, one longer
    than a program's chunk, and several dtypes."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    fused = torch.zeros(4, 2 * 24, 32, dtype=torch.bfloat16, device=device)
    flat = torch.zeros(1000, dtype=torch.bfloat16, device=device)
    wide = torch.zeros(64, 48, dtype=torch.float32, device=device)
    dst = [fused[0, :24], fused[0, 24:], fused[3, 24:],
           flat[1:8],        # 2-byte aligned, 14 bytes
           flat[10:16],      # 4-byte aligned, 12 bytes: not 16-byte, the launch drops to 4-byte accesses
           flat[100:103],    # 6 bytes: not a multiple of 4
           flat[200:200],    # empty
           wide[:, :16],     # not contiguous
           torch.zeros(_CHUNK + 37, dtype=torch.float32, device=device),
           torch.zeros(5, 7, dtype=torch.int8, device=device)]
    src = [rnd(*d.shape, dtype=d.dtype) if d.dtype.is_floating_point
           else torch.randint(-100, 100, d.shape, dtype=d.dtype, generator=g).to(device) for d in dst]
    return dst, src


def _expected(dst: list[torch.Tensor], src: list[torch.Tensor]) -> list[torch.Tensor]:
    want = [d.clone() for d in dst]
    for w, s in zip(want, src):
        w.copy_(s)
    return want


def test_copy_many_on_cpu_writes_what_copy_would():
    dst, src = _pairs("cpu")
    copy_many(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


def test_copy_many_of_nothing_does_nothing():
    copy_many([], [])


_CHILD = r"""
import os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import torch
from tests.reload.test_grouped_copy import _pairs, _expected
from weight_sync.reload.grouped_copy import _copy_grouped
dst, src = _pairs("cpu")
want = _expected(dst, src)
_copy_grouped(dst, src)
bad = [i for i, (d, w) in enumerate(zip(dst, want)) if not torch.equal(d, w)]
assert not bad, bad
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_grouped_kernel_under_the_interpreter_copies_every_byte_and_routes_the_rest():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")


@pytest.mark.gpu
def test_copy_many_on_cuda_is_bitwise_copy_for_every_kind_of_pair():
    dst, src = _pairs("cuda")
    want = _expected(dst, src)
    copy_many(dst, src)
    torch.cuda.synchronize()
    assert all(torch.equal(d, w) for d, w in zip(dst, want))


@pytest.mark.gpu
def test_copy_many_on_cuda_fills_moe_shaped_expert_slices():
    w13 = torch.zeros(16, 2 * 768, 2048, dtype=torch.bfloat16, device="cuda")
    dst = [w13[e, h * 768:(h + 1) * 768] for e in range(16) for h in range(2)]
    src = [torch.randn(768, 2048, dtype=torch.bfloat16, device="cuda") for _ in dst]
    copy_many(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(w13, torch.stack([torch.cat(src[2 * e:2 * e + 2]) for e in range(16)]))


def test_a_copy_group_off_cuda_copies_through_torch():
    dst, src = _pairs("cpu")
    CopyGroup(dst).copy(src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))


@pytest.mark.gpu
def test_a_copy_group_on_cuda_copies_aligned_misaligned_and_strided_sources_bitwise():
    fused = torch.zeros(8, 2 * 64, 256, dtype=torch.bfloat16, device="cuda")
    dst = [fused[e, h * 64:(h + 1) * 64] for e in range(8) for h in range(2)]
    group = CopyGroup(dst)
    assert group.words is not None and group.vec
    backing = torch.randn(len(dst) * 64 * 256 + 2, dtype=torch.bfloat16, device="cuda")
    for shift, what in ((0, "16-byte aligned"), (2, "4-byte aligned"), (1, "2-byte aligned")):
        src = [backing[shift + i * 64 * 256: shift + (i + 1) * 64 * 256].view(64, 256) for i in range(len(dst))]
        fused.zero_()
        group.copy(src)
        torch.cuda.synchronize()
        assert all(torch.equal(d, s) for d, s in zip(dst, src)), what
    strided = [torch.randn(256, 64, dtype=torch.bfloat16, device="cuda").t() for _ in dst]
    group.copy(strided)
    torch.cuda.synchronize()
    assert all(torch.equal(d, s) for d, s in zip(dst, strided)), "non-contiguous sources"


@pytest.mark.gpu
def test_a_moe_list_replayed_on_cuda_in_pieces_equals_a_fresh_load(monkeypatch):
    import weight_sync.reload.replay as replay
    from weight_sync import Manifest, begin_update
    from weight_sync.engine import ReferenceEngine
    from weight_sync.testing import assert_bitwise_equal, hf_config, random_weights

    monkeypatch.setattr(replay, "PIECE_KEYS", 16)
    cfg = hf_config("qwen3_moe", "tiny")
    engine = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=0, device="cuda"), device="cuda",
                                         use_cuda_graph=False)
    for seed in (1, 2, 3):
        items = [(n, t.contiguous()) for n, t in random_weights(cfg, seed=seed, device="cuda")]
        with begin_update(engine.model, Manifest.from_named_tensors(items)) as s:
            s.load(items)
        fresh = ReferenceEngine.from_config(cfg, weights=random_weights(cfg, seed=seed, device="cuda"),
                                            device="cuda", use_cuda_graph=False)
        assert_bitwise_equal(engine.model, fresh.model)
