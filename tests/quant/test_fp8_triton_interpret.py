"""The Triton fp8 kernels (fused block/channel, one weight or grouped; absmax + cast per tensor) under Triton's CPU interpreter against the torch path: the same bits.

``TRITON_INTERPRET=1`` must be set before a kernel is decorated, and the decorated kernels are cached
per process, so the kernels run in one child process for all cases; each test then compares one case
with the torch path here. The GPU tests (test_fp8_gpu.py) run the same cases compiled.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.quant._fp8_cases import (
    CONFIGS,
    DTYPES,
    SHAPES,
    SPECIAL_CONFIGS,
    assert_same_bits,
    random_weight,
    run_interpreted,
    special_weight,
)
from weight_sync.quant.fp8 import Fp8Config, quantize_fp8
from weight_sync.quant.fp8_triton import quantize_fp8_fused

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="Triton is not installed: no interpreter to run the kernels"
)

# The interpreter's own fp32 -> fp8 conversion is not the GPU's: it rounds half-up on a single bit
# (no ties-to-even, no sticky bits) and maps NaN to a finite value. GPUs convert with
# cvt.rn.satfinite (round to nearest even), as does torch's CPU cast, so the child swaps in torch's,
# after checking that the kernel asks for round-to-nearest-even.
_CHILD = r"""
import os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
import numpy as np, torch
import triton.language as tl
from triton.runtime import interpreter
from weight_sync.quant.fp8 import _EPS, FP8_MAX
from weight_sync.quant.fp8_triton import absmax_bits_fp8, quantize_fp8_fused, tensor_cast_fp8

convert = interpreter.InterpreterBuilder.create_fp_to_fp
def create_fp_to_fp(self, src, dst_type, rounding_mode):
    if src.dtype == tl.float32 and dst_type.scalar == tl.float8e4nv:
        assert rounding_mode == interpreter._ir.ROUNDING_MODE.RTNE, rounding_mode
        data = torch.from_numpy(src.data).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return interpreter.TensorHandle(data, dst_type.scalar)
    return convert(self, src, dst_type, rounding_mode)
interpreter.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
np.seterr(invalid="ignore", divide="ignore")  # inf / inf and NaN lanes: expected

out = {}
for name, c in torch.load(sys.argv[1]).items():
    w = c["w"]
    if c["granularity"] == "tensor":  # absmax kernel, then the cast kernel computing the scale
        q, s = tensor_cast_fp8(w, absmax_bits_fp8(w), FP8_MAX, _EPS)
    else:
        q, s = quantize_fp8_fused(w, c["granularity"], c["block"], FP8_MAX, _EPS)
    out[name] = {"q": q, "scale": s, "stride": w.stride()}
# The grouped kernel: every case of one configuration in one call, into fresh outputs.
from weight_sync.quant.fp8_grouped import quantize_fp8_grouped
by_config = {}
for name, c in torch.load(sys.argv[1]).items():
    if c["granularity"] != "tensor" and c["w"].numel() and c["w"].stride(1) == 1:
        by_config.setdefault((c["granularity"], c["block"]), []).append(name)
cases = torch.load(sys.argv[1])
for (granularity, block), names in by_config.items():
    items = [(cases[n]["w"], torch.empty_like(out[n]["q"]), torch.empty_like(out[n]["scale"])) for n in names]
    quantize_fp8_grouped(items, granularity, block, FP8_MAX, _EPS)
    for n, (_, q, s) in zip(names, items):
        out[n]["grouped"] = (q, s)
# The grouped per-tensor kernels: every tensor case as a matrix of up to three row bands, all in one call.
from weight_sync.quant.fp8_grouped import quantize_fp8_matrices_grouped
matrices, names = [], []
for name, c in cases.items():
    w = c["w"]
    if c["granularity"] == "tensor" and w.numel() and w.stride(1) == 1:
        n = w.shape[0]
        q, s = torch.empty(w.shape, dtype=torch.float8_e4m3fn), torch.empty(1)
        cuts = sorted({0, n // 3, 2 * n // 3, n})
        matrices.append([(w[a:b], q[a:b], s) for a, b in zip(cuts, cuts[1:]) if b > a])
        names.append(name)
quantize_fp8_matrices_grouped(matrices, FP8_MAX, _EPS)
for name, bands in zip(names, matrices):
    out[name]["matrix"] = (torch.cat([q for _, q, _ in bands]), bands[0][2])
# The per-tensor launches from a table made once for fixed targets: each matrix as up to three bands
# (fresh, aligned sources), every matrix of one source dtype in one GroupedMatrices.
from weight_sync.quant.fp8_grouped import GroupedMatrices
per_dtype = {}
for name in names:
    w = cases[name]["w"]
    q, s = torch.zeros(w.shape, dtype=torch.float8_e4m3fn), torch.zeros(1)
    n = w.shape[0]
    cuts = sorted({0, n // 3, 2 * n // 3, n})
    group = per_dtype.setdefault(w.dtype, ([], [], []))
    for a, b in zip(cuts, cuts[1:]):
        if b > a:
            group[0].append((q[a:b], s))
            group[1].append(w[a:b].clone())
    group[2].append((name, q, s))
for dtype, (targets, srcs, made) in per_dtype.items():
    ready = GroupedMatrices(targets, [tuple(t.shape) for t in srcs], dtype, FP8_MAX, _EPS)
    assert ready.launch(srcs)
    for name, q, s in made:
        out[name]["matrix_tabled"] = (q, s)
# The same launches from a table made once for fixed targets (a replayed bucket list's path).
from weight_sync.quant.fp8_grouped import GroupedBands
by_dtype = {}
for name, c in cases.items():
    w = c["w"]
    if c["granularity"] != "tensor" and w.numel() and w.is_contiguous():
        by_dtype.setdefault((c["granularity"], c["block"], w.dtype), []).append(name)
for (granularity, block, dtype), names in by_dtype.items():
    targets = [(torch.empty_like(out[n]["q"]), torch.empty_like(out[n]["scale"])) for n in names]
    ready = GroupedBands(targets, [tuple(cases[n]["w"].shape) for n in names], dtype, granularity, block,
                         FP8_MAX, _EPS)
    assert ready.launch([cases[n]["w"] for n in names])
    for n, t in zip(names, targets):
        out[n]["tabled"] = t
torch.save(out, sys.argv[2])
"""


def _cases() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    seed = 0
    for dtype in DTYPES:
        dt = str(dtype).removeprefix("torch.")
        for granularity, block in CONFIGS:
            for shape in SHAPES:
                seed += 1
                cases[f"{granularity}{block}-{dt}-{shape}"] = {
                    "w": random_weight(shape, dtype, seed), "granularity": granularity, "block": block}
        for granularity, block in [*SPECIAL_CONFIGS, ("tensor", (128, 128))]:
            seed += 1
            cases[f"special-{granularity}{block}-{dt}"] = {
                "w": special_weight((200, 300), dtype, seed), "granularity": granularity, "block": block}
        for shape in ((200, 300), (129, 129), (256, 384)):  # per-tensor: absmax + cast, one weight or bands of it
            seed += 1
            cases[f"tensor-{dt}-{shape}"] = {"w": random_weight(shape, dtype, seed), "granularity": "tensor",
                                             "block": (128, 128)}
    # Rows longer than one 128x128 tile: per-channel scales over a column loop (two reads).
    long = random_weight((5, 20000), torch.bfloat16, 100)
    long[1, 7777], long[2, 19999], long[3, 5] = float("nan"), float("inf"), -0.0
    cases["channel-long-rows"] = {"w": long, "granularity": "channel", "block": (128, 128)}
    # A row stride that is not the width: a column slice of a wider weight.
    for granularity in ("block", "channel"):
        wide = special_weight((200, 700), torch.bfloat16, 101)
        cases[f"strided-{granularity}"] = {"w": wide[:, 100:400], "granularity": granularity, "block": (128, 128)}
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_interpreted(_CHILD, CASES, tmp_path_factory.mktemp("fp8_interpret"))


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_the_interpreted_kernel_quantizes_bitwise_like_the_torch_path(name: str, interpreted) -> None:
    case, got = CASES[name], interpreted[name]
    assert got["stride"] == case["w"].stride()
    ref_q, ref_s = quantize_fp8(case["w"], Fp8Config(granularity=case["granularity"], block_size=case["block"]))
    assert_same_bits(got["q"], got["scale"], ref_q, ref_s, name)


GROUPED = [n for n, c in CASES.items() if c["granularity"] != "tensor" and c["w"].numel() and c["w"].stride(1) == 1]


@needs_triton
@pytest.mark.parametrize("name", GROUPED)
def test_the_grouped_kernel_quantizes_every_weight_of_one_launch_bitwise_like_the_torch_path(
    name: str, interpreted,
) -> None:
    case, (q, s) = CASES[name], interpreted[name]["grouped"]
    ref_q, ref_s = quantize_fp8(case["w"], Fp8Config(granularity=case["granularity"], block_size=case["block"]))
    assert_same_bits(q, s, ref_q, ref_s, name)


TABLED = [n for n, c in CASES.items() if c["granularity"] != "tensor" and c["w"].numel() and c["w"].is_contiguous()]


@needs_triton
@pytest.mark.parametrize("name", TABLED)
def test_the_grouped_kernel_from_a_table_made_once_quantizes_bitwise_like_the_torch_path(name: str,
                                                                                       interpreted) -> None:
    case, (q, s) = CASES[name], interpreted[name]["tabled"]
    ref_q, ref_s = quantize_fp8(case["w"], Fp8Config(granularity=case["granularity"], block_size=case["block"]))
    assert_same_bits(q, s, ref_q, ref_s, name)


def test_a_table_made_once_launches_nothing_for_a_strided_or_misaligned_source() -> None:
    from weight_sync.quant.fp8 import _EPS, FP8_MAX
    from weight_sync.quant.fp8_grouped import GroupedBands

    q, s = torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.zeros(1, 2)
    ready = GroupedBands([(q, s)], [(128, 256)], torch.bfloat16, "block", (128, 128), FP8_MAX, _EPS)
    wide = torch.randn(128, 512).to(torch.bfloat16)
    flat = torch.randn(128 * 256 + 1).to(torch.bfloat16)
    assert not ready.launch([wide[:, :256]])  # rows 1024 bytes apart, not 512: not contiguous
    assert not ready.launch([flat[1:].view(128, 256)])  # 2 bytes past an aligned address
    assert not q.view(torch.uint8).any() and not s.any()  # nothing was written


MATRICES = [n for n, c in CASES.items() if c["granularity"] == "tensor" and c["w"].numel() and c["w"].stride(1) == 1]


@needs_triton
@pytest.mark.parametrize("name", MATRICES)
def test_the_grouped_per_tensor_kernels_quantize_a_matrix_given_as_bands_like_the_whole(name: str,
                                                                                         interpreted) -> None:
    case, (q, s) = CASES[name], interpreted[name]["matrix"]
    ref_q, ref_s = quantize_fp8(case["w"], Fp8Config(granularity="tensor"))
    assert_same_bits(q, s, ref_q, ref_s, name)


@needs_triton
@pytest.mark.parametrize("name", MATRICES)
def test_the_per_tensor_kernels_from_a_table_made_once_quantize_a_matrix_given_as_bands_like_the_whole(
    name: str, interpreted,
) -> None:
    case, (q, s) = CASES[name], interpreted[name]["matrix_tabled"]
    ref_q, ref_s = quantize_fp8(case["w"], Fp8Config(granularity="tensor"))
    assert_same_bits(q, s, ref_q, ref_s, name)


def test_a_per_tensor_table_made_once_launches_nothing_for_a_strided_or_misaligned_source() -> None:
    from weight_sync.quant.fp8 import _EPS, FP8_MAX
    from weight_sync.quant.fp8_grouped import GroupedMatrices

    q, s = torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.zeros(1)
    ready = GroupedMatrices([(q[:64], s), (q[64:], s)], [(64, 256), (64, 256)], torch.bfloat16, FP8_MAX, _EPS)
    wide = torch.randn(64, 512).to(torch.bfloat16)
    flat = torch.randn(64 * 256 + 1).to(torch.bfloat16)
    ok = torch.randn(64, 256).to(torch.bfloat16)
    assert not ready.launch([ok, wide[:, :256]])  # not contiguous
    assert not ready.launch([flat[1:].view(64, 256), ok])  # 2 bytes past an aligned address
    assert not q.view(torch.uint8).any() and not s.any()  # nothing was written


def test_the_fused_kernel_refuses_what_it_does_not_handle() -> None:
    w = torch.ones(4, 4)
    for args in ((w, "tensor", (128, 128)), (w, "block", (1 << 15, 1)), (w.t()[:, :2], "block", (128, 128)),
                 (w[:0], "channel", (128, 128)), (w[0], "channel", (128, 128))):
        with pytest.raises(ValueError, match="fused fp8 needs"):
            quantize_fp8_fused(*args, fmax=448.0, eps=1e-12)


def test_importing_weight_sync_and_quantizing_on_cpu_never_imports_triton() -> None:
    code = (
        "import sys, torch\n"
        "import weight_sync\n"
        "from weight_sync.quant import Fp8Config, quantize_fp8\n"
        "for g in ('tensor', 'channel', 'block'):\n"
        "    quantize_fp8(torch.randn(130, 70), Fp8Config(granularity=g))\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip() == "ok"
